"""A shard's keys as a whole: snapshots taken, read (the RDB reader) and loaded back."""
