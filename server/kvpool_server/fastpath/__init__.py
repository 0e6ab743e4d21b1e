"""The shared-memory fast path: a transport beside grpc_api/ over the same service layer (docs/fast-path.md)."""
