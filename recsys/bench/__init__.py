"""``python -m recsys bench-recovery``: what each recovery strategy costs, and restores against shard size."""
