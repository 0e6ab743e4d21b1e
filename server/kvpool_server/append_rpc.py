"""The one request -> plan -> response path of AppendToken and of each AppendTokenStream message.

A stream message is one AppendToken: the same checks, the same lock, the copy-on-write copies run on the pool
before the response exists, and the same errors. The two RPCs differ only in their message classes, which carry
the same fields (AppendTokenStreamRequest/Response mirror AppendTokenRequest/Response field for field).

Before the core is called, the reply's worst-case size is checked against the call's reply limit
(``reply_limits``): an append whose reply might not be deliverable is refused, not applied and then lost.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, TypeVar

from kvpool_server import parse
from kvpool_server.core import KVCacheManager
from kvpool_server.pool_protocol import Pool
from kvpool_server.reply_limits import ReplyLimits
from kvpool_server.responses import append_response
from kvpool_server.session_gate import SessionGate

R = TypeVar("R")


def append(
    manager: KVCacheManager,
    pool: Pool,
    lock: AbstractContextManager[Any],
    gate: SessionGate,
    request: Any,
    response_cls: type[R],
    *,
    max_batch: int,
    rpc: str,
    limits: ReplyLimits | None = None,
    limit: Any = None,
    tenant: int | None = None,
    events: Any = None,
) -> R:
    """Apply one append request (``seq_ids``, ``num_tokens``, maybe ``token_ids`` for prefix caching) atomically under ``lock`` (the one that covers
    ``manager`` and ``pool``), through ``gate`` (the session must be live; a repeated request id is answered
    with its first answer); ``response_cls`` has AppendTokenResponse's fields. Raises, having changed nothing,
    on any error; ``rpc`` names the method in error messages. With ``limits``, ``limit`` is the call's context (or
    ``limits.limit(context)``'s result): a request whose reply might exceed it is refused. ``tenant``: the caller's
    (another tenant's sequence is NOT_FOUND; the tenant's quotas bound the blocks taken), None without auth."""
    seq_ids = parse.batch_seq_ids(request.seq_ids, rpc, max_batch)
    num_tokens = parse.append_counts(request.num_tokens, seq_ids.size)
    token_ids = request.token_ids if len(request.token_ids) else None  # prefix caching; None: no per-token work
    if limits is not None:
        limits.check_append(seq_ids.size, num_tokens, rpc, limit)
    with lock:
        key, replay = gate.enter(request, response_cls, tenant)
        if replay is not None:
            return replay
        plan = manager.append(seq_ids, num_tokens, tenant, token_ids)
        if events is not None and events.log.pending:  # prefix cache: blocks sealed or evicted (SubscribeEvents)
            events.publish()
        if plan.copies.shape[0]:
            pool.copy_blocks(plan.copies)
        if key is None:
            return append_response(plan, response_cls)
        return gate.remember(key, append_response(plan, response_cls))
