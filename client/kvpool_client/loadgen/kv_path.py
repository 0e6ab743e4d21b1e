"""How a load-generator process moves KV (``--kv-path``, docs/loadgen.md): through the mapped pool, or over gRPC.

    attach  map the pool (attach(): shared memory or CUDA IPC) and write/read slots in place -- the fast path,
            which needs the server's IPC namespace (same host, or a container sharing it) and ``may_attach``
    grpc    WriteKV / ReadKV: works from anywhere the gRPC port reaches (another host, another container, a
            tenant without may_attach), one WriteKV per sequence written, verification by ReadKV
    auto    attach when the pool can be mapped, else grpc, saying why (the default)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool_client.attach import AttachedPool
from kvpool_client.client import KVPoolClient
from kvpool_client.errors import AttachNotAllowedError
from kvpool_client.rank_group import RankGroup

KV_PATHS = ("auto", "attach", "grpc")


class CannotAttach(RuntimeError):
    """``--kv-path attach`` and the pool cannot be mapped; the message says why."""


def map_pool(client: KVPoolClient, kv_path: str) -> tuple[AttachedPool | RankGroup | None, str]:
    """(the mapped pool -- every rank's shard of a tensor-parallel pool --, "") or (None, why KV goes over gRPC)."""
    if kv_path == "grpc":
        return None, "--kv-path grpc"
    try:
        return client.attach_ranks(), ""
    except AttachNotAllowedError:
        why = "this tenant may not attach the pool (no may_attach in the server's tokens file)"
    except (OSError, RuntimeError) as error:  # no such shm segment here; a CUDA IPC handle of another host/container
        why = (f"the pool cannot be mapped from here ({type(error).__name__}: {error}): the server is on another "
               "host, or in another container or IPC namespace")
    if kv_path == "attach":
        raise CannotAttach(f"--kv-path attach: {why}; --kv-path grpc (or auto) moves KV over gRPC instead")
    return None, why


def write_over_grpc(client: KVPoolClient, runs: list[tuple[int, int, int]], data: np.ndarray,
                    timed: Any = None) -> None:
    """Write ``data`` (tokens in the order of ``runs``) with one WriteKV per run ``(seq_id, start, num_tokens)``."""
    offset = 0
    for seq_id, start, count in runs:
        client.write_kv(seq_id, start, data[offset:offset + count])
        offset += count
    if offset != len(data):
        raise ValueError(f"runs cover {offset} tokens, data has {len(data)}")
