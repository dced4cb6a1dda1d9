"""Row saves between checkpoints, off the training path: priority saves and incremental flushes."""
