"""Criteo readers, a synthetic click stream with a known ceiling, resumable batches."""
