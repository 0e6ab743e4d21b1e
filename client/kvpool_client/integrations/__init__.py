"""Frontends whose KV cache is kvpool (optional extra ``kvpool[torch]``: PyTorch, transformers, Triton)."""
