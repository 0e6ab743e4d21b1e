"""kvpool-common: what the server and its clients share, and nothing else.

- ``kvpool.v1``     the wire contract: generated protobuf messages and gRPC stubs of ``protos/kvpool/v1/kvpool.proto``
- ``kvpool.layout`` KVLayout: the shape of the pool's memory (block-major), and views over it
- ``kvpool.shm``    opening the host backend's POSIX shared-memory segment by name
- ``kvpool.block_hash`` the prefix cache's block hash (docs/prefix-caching.md): the server's core and the
  engines' in-process baseline hash with it

This ``__init__`` imports nothing, so ``kvpool.layout`` and ``kvpool.shm`` load without grpc or protobuf (the
server's device layer uses them).
"""
