"""The paged KV cache's bookkeeping: block pools, prefix hashes, per-sequence block tables."""
