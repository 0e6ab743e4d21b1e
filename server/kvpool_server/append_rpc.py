"""The one request -> plan -> response path of AppendToken and of each AppendTokenStream message.

A stream message is one AppendToken: the same validation, the same lock, the copy-on-write copies run on the pool
before the response exists, and the same errors. The two RPCs differ only in their message classes, which carry
the same fields (AppendTokenStreamRequest/Response mirror AppendTokenRequest/Response field for field).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.core import InvalidArgumentError, SequenceNotFoundError

if TYPE_CHECKING:
    from kvpool_server.service import KVPoolServicer

R = TypeVar("R")


def append(servicer: KVPoolServicer, request: Any, response_cls: type[R], rpc: str) -> R:
    """Apply one append request (``seq_ids``, ``num_tokens``) atomically; ``response_cls`` has AppendTokenResponse's
    fields. Raises (having changed nothing) on any error; ``rpc`` names the method in error messages."""
    seq_ids = servicer.batch_ids(request.seq_ids, rpc)
    counts = request.num_tokens
    if len(counts) == 0:
        num_tokens: int | np.ndarray = 1
    elif len(counts) == 1:
        num_tokens = counts[0]
    elif len(counts) == seq_ids.size:
        num_tokens = np.array(counts, dtype=np.int64)
    else:
        raise InvalidArgumentError(
            f"{len(counts)} num_tokens values for {seq_ids.size} seq_ids: give one per seq_id, one for all, "
            "or none (1 each)"
        )
    with servicer.lock:
        try:
            plan = servicer.manager.append(seq_ids, num_tokens)
        except SequenceNotFoundError:
            check_no_zero(seq_ids, rpc)  # say INVALID_ARGUMENT for a 0, not NOT_FOUND
            raise
        if plan.copies.shape[0]:
            servicer.pool.copy_blocks(plan.copies)
    response = response_cls(slot_mapping=plan.slot_mapping.tolist(), new_block_ids=plan.new_block_ids.tolist())
    if plan.copies.shape[0]:
        response.copies.extend(  # type: ignore[attr-defined]
            pb.BlockCopy(src_block_id=s, dst_block_id=d) for s, d in plan.copies.tolist()
        )
    return response


def check_no_zero(seq_ids: np.ndarray, rpc: str) -> None:
    """0 is proto3's unset value, never a sequence: INVALID_ARGUMENT (the core alone would say NOT_FOUND)."""
    if not seq_ids.all():
        raise InvalidArgumentError(f"{rpc}: seq_id 0 is not a sequence (0 means unset)")
