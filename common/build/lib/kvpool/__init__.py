"""kvpool-common: what the server and its clients share, and nothing else.

- ``kvpool.v1``     the wire contract: generated protobuf messages and gRPC stubs of ``protos/kvpool/v1/kvpool.proto``
- ``kvpool.layout`` KVLayout: the shape of the pool's memory (block-major), and views over it
- ``kvpool.shm``    opening the host backend's POSIX shared-memory segment by name

This ``__init__`` imports nothing, so ``kvpool.layout`` and ``kvpool.shm`` load without grpc or protobuf (the
server's device layer uses them).
"""
