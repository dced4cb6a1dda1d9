"""A run's folder and what is read back from it: outputs, summary, verify, compare, export, metrics."""
