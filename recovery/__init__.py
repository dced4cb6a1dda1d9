"""Checkpoints, persistent update logs, failure injection and partial recovery of shards."""
