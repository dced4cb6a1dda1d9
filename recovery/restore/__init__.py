"""The ways back from a failure: a shard's restore per strategy, a trainer's restart, training through."""
