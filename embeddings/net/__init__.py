"""The wire to Redis: connections and failover, bulk row I/O, Cluster slots, endpoint checks, namespace claims."""
