"""Frontends whose KV cache is kvpool (optional extra ``kvpool-client[torch]``: PyTorch, transformers, Triton)."""
