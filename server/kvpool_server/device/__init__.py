"""The device layer: the pool of KV blocks on the GPU (CuPy) or in host shared memory. Imports no CuPy."""

from kvpool_server.device.create import create_pool
from kvpool_server.device.pool import KVPool, PoolAttachInfo, gpu_available

__all__ = ["KVPool", "PoolAttachInfo", "create_pool", "gpu_available"]
