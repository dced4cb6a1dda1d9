"""Local ``redis-server`` shards: started, failed, supervised and stopped."""
