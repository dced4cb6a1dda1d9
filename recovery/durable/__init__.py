"""What a run keeps on disk: file writes, update logs, row files, checkpoints, dense state, their layout."""
