"""One request record -> the call scope -> the same ``KVPoolService`` method gRPC calls -> one reply record.

Nothing the client wrote is trusted: the header is copied into Python ints once, every count is checked against
the area before an array is read, and the arrays are copied out of the segment before the service sees them (the
client cannot change a request while it is applied). Whatever goes wrong -- a bad op, a count past the area, an
id 0, a fenced session -- is an exception inside the scope, so it gets the same status as on gRPC and the core is
left exactly as it was (the core validates fully before it changes anything). The reply is written in full, then
published by ``CTL_REP_SEQ``.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from kvpool import fastpath as fp
from kvpool_server.core import InvalidArgumentError
from kvpool_server.fastpath.channel import memory_barrier
from kvpool_server.service.errors import Status
from kvpool_server.service.kvpool import KVPoolService, Registered
from kvpool_server.service.reply_limits import RECEIVE_LIMIT_KEY
from kvpool_server.service.scope import CallScope

U64 = (1 << 64) - 1


class ChannelHeaders:
    """A record's headers: the channel's authorization (checked again at every record: a token revoked by SIGHUP
    is refused at the next one) and no gRPC reply limit (the reply area's bound is checked here)."""

    __slots__ = ("authorization",)

    def __init__(self, authorization: str | None) -> None:
        self.authorization = authorization

    def get(self, key: str) -> str | None:
        if key == "authorization":
            return self.authorization
        if key == RECEIVE_LIMIT_KEY:
            return "-1"
        return None


def serve_record(service: KVPoolService, scope: CallScope, views: fp.Views, headers: ChannelHeaders,
                 session_id: int, generation: int, seq: int, prepared: Any = None) -> None:
    """Serve the request record ``seq`` of a channel and write its reply (never raises for a bad record).
    ``prepared``: the record as ``fair_channels`` copied it out, its prompt hashed (``Prepared``)."""
    memory_barrier()  # the record's loads after the seq's
    header = views.req.tolist() if prepared is None else prepared.header  # one copy: it cannot change under us
    op = header[fp.REQ_OP]
    call = scope.call(fp.OP_NAMES.get(op, "FastPath"), headers)
    try:
        with call:
            if header[fp.REQ_SEQ] != seq or header[fp.REQ_GENERATION] != generation:
                raise InvalidArgumentError(
                    f"fast path: a record for seq {header[fp.REQ_SEQ]} generation {header[fp.REQ_GENERATION]}; this "
                    f"channel serves seq {seq} of generation {generation}")
            answer = _apply(service, call, views, header, op, session_id, prepared)
    except Exception:
        write_error(views, seq, call.status)
        return
    write_answer(views, seq, op, answer)


def _arrays(views: fp.Views, header: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes]:
    """The request's arrays, checked against the area and copied out of it."""
    area = views.area_bytes
    n_ids, n_counts, n_tokens, extra = (header[fp.REQ_N_IDS], header[fp.REQ_N_COUNTS], header[fp.REQ_N_TOKENS],
                                        header[fp.REQ_EXTRA_LEN])
    if not (0 <= n_ids <= area and 0 <= n_counts <= area and 0 <= n_tokens <= area and 0 <= extra <= area) or \
            fp.request_bytes(n_ids, n_counts, n_tokens, extra) > area:
        raise InvalidArgumentError(f"fast path: a request of {n_ids} ids, {n_counts} counts, {n_tokens} tokens and "
                                   f"{extra} key bytes does not fit the {area}-byte request area")
    buf = views.req_area
    at = fp.HEADER_BYTES
    ids = buf[at:at + 8 * n_ids].view(np.uint64).copy()
    at += 8 * n_ids
    counts = buf[at:at + 4 * n_counts].view(np.uint32).astype(np.int64)
    at += fp.align8(4 * n_counts)
    tokens = buf[at:at + 4 * n_tokens].view(np.uint32).copy()
    at += fp.align8(4 * n_tokens)
    return ids, counts, tokens, buf[at:at + extra].tobytes()


def _apply(service: KVPoolService, call: Any, views: fp.Views, header: list[int], op: int, session_id: int,
           prepared: Any = None) -> Any:
    ids, counts, tokens, extra = _arrays(views, header) if prepared is None else prepared.arrays
    request_id = header[fp.REQ_REQUEST_ID] & U64
    arg0, arg1 = header[fp.REQ_ARG0] & U64, header[fp.REQ_ARG1]
    if op == fp.OP_APPEND:
        n = ids.size
        total = n if not counts.size else int(counts[0]) * n if counts.size == 1 else int(counts.sum())
        if fp.append_reply_bound(n, total, service.guard.manager.block_size) > views.area_bytes:
            raise InvalidArgumentError(f"fast path: the reply of an append of {total} tokens may not fit the "
                                       f"{views.area_bytes}-byte reply area: send it over gRPC")
        if len(service.pins):
            _wait_unpinned(service, ids)
        count_arg: Any = [int(counts[0])] if counts.size == 1 else counts
        return service.append(call, cast(Any, ids), count_arg, cast(Any, tokens), session_id, request_id)
    if op == fp.OP_REGISTER:
        if arg1 < 0:
            raise InvalidArgumentError(f"RegisterSequence public_prefix_len must be >= 0, got {arg1}")
        return service.register(call, arg0 or None, session_id, request_id, cast(Any, tokens), arg1, extra,
                                None if prepared is None else prepared.hashes)
    if op == fp.OP_FORK:
        if not 0 <= arg1 <= service.max_batch:
            raise InvalidArgumentError(f"Fork num_children must be in [0, max_batch={service.max_batch}], got {arg1}")
        if fp.reply_bytes(0, 0, 0, 0, max(arg1, ids.size)) > views.area_bytes:
            raise InvalidArgumentError("fast path: the Fork's reply does not fit the reply area: use gRPC")
        _wait_unpinned(service, [arg0])
        return service.fork(call, arg0, arg1, ids.tolist(), session_id, request_id)
    if op == fp.OP_FREE:
        _wait_unpinned(service, ids)
        return service.free(call, ids.tolist(), session_id, request_id)
    raise InvalidArgumentError(f"fast path: unknown op {op}")


def _wait_unpinned(service: KVPoolService, ids: Any) -> None:
    """A sequence with a big WriteKV/ReadKV copy in flight is not changed until the copy ends (``SequencePins``;
    its own wait is the event loop's): wait here, on the fast-path thread, in 1 ms steps."""
    import time

    pinned: Any = getattr(service.pins, "_pins", None)
    while pinned and any(int(s) in pinned for s in ids):
        time.sleep(0.001)


def write_answer(views: fp.Views, seq: int, op: int, answer: Any) -> None:
    rep, area = views.rep, views.rep_area
    rep[fp.REP_CODE:fp.REP_MSG_LEN + 1] = 0  # code, reason, message length
    if op == fp.OP_APPEND:
        slots, new, copies = answer.slot_mapping, answer.new_block_ids, answer.copies
        at = fp.HEADER_BYTES
        area[at:at + 8 * slots.size].view(np.int64)[:] = slots
        at += 8 * slots.size
        if new.size:
            area[at:at + 4 * new.size].view(np.int32)[:] = new
            at += fp.align8(4 * new.size)
        if copies.shape[0]:
            area[at:at + 8 * copies.shape[0]].view(np.int32)[:] = copies.reshape(-1)
        rep[fp.REP_N_SLOTS:fp.REP_N_CHILDREN + 1] = (slots.size, new.size, copies.shape[0], 0)
    elif op == fp.OP_FORK:
        children = np.asarray(answer, dtype=np.uint64)
        area[fp.HEADER_BYTES:fp.HEADER_BYTES + 8 * children.size].view(np.uint64)[:] = children
        rep[fp.REP_N_SLOTS] = rep[fp.REP_N_NEW] = rep[fp.REP_N_COPIES] = 0
        rep[fp.REP_N_CHILDREN] = children.size
    else:
        if isinstance(answer, Registered):
            rep[fp.REP_VALUE0] = np.uint64(answer.seq_id).view(np.int64)
            rep[fp.REP_VALUE1] = answer.num_cached_tokens
        else:
            rep[fp.REP_VALUE0] = int(answer)
        rep[fp.REP_N_SLOTS] = rep[fp.REP_N_NEW] = rep[fp.REP_N_COPIES] = rep[fp.REP_N_CHILDREN] = 0
    rep[fp.REP_SEQ] = seq
    memory_barrier()  # the reply's stores before the seq's (x86 keeps them in order anyway; ARM does not)
    views.ctl[fp.CTL_REP_SEQ] = seq  # published: the whole reply is written


def write_error(views: fp.Views, seq: int, status: Status) -> None:
    rep, area = views.rep, views.rep_area
    message = status.message.encode("utf-8", "replace")[:fp.MAX_MESSAGE_BYTES]
    area[fp.HEADER_BYTES:fp.HEADER_BYTES + len(message)] = np.frombuffer(message, np.uint8)
    rep[fp.REP_CODE] = int(status.code)
    rep[fp.REP_REASON] = fp.REASONS.index(status.reason) if status.reason in fp.REASONS else 0
    rep[fp.REP_MSG_LEN] = len(message)
    rep[fp.REP_N_SLOTS] = rep[fp.REP_N_NEW] = rep[fp.REP_N_COPIES] = rep[fp.REP_N_CHILDREN] = 0
    rep[fp.REP_SEQ] = seq
    memory_barrier()
    views.ctl[fp.CTL_REP_SEQ] = seq
