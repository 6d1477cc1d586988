"""The paged KV cache: block bookkeeping (pure Python) and the cache tensors."""
