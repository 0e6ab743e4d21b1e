"""kvpool server: a KV-cache block manager for LLM serving, as a gRPC service."""

__version__ = "0.1.0"
