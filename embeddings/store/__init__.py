"""The row store: its protocol, the Redis store and its parts (reads, writes, held rows, markers, outages)."""
