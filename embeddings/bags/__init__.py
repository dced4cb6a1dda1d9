"""The torchrec-compatible embedding-bag module, its fbgemm kernels and its prefetch."""
