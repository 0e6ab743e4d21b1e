"""One request record -> the call scope -> the same ``KVPoolService`` method gRPC calls -> one reply record.

Nothing the client wrote is trusted: the header is copied into Python ints once, every count is checked against
the area before an array is read, and the arrays are copied out of the segment before the service sees them (the
client cannot change a request while it is applied). Whatever goes wrong -- a bad op, a count past the area, an
id 0, a fenced session -- is an exception inside the scope, so it gets the same status as on gRPC and the core is
left exactly as it was (the core validates fully before it changes anything). A reply that might not fit the reply
area is refused before anything is applied (``append_reply_bound``: the real worst case; a register-many record's
in ``register_many.py``, which also says how its prompts are hashed; a step record's -- a Free, an append and a
register in one -- in ``step.py``). The reply is written in
full, then published by ``CTL_REP_SEQ``. The bytes are the codec's (``kvpool.fastpath_codec``, the client's too):
this module decides what is read, checked and answered.

Every answer of the service goes through the adapter gRPC's handlers use (``service/answers.honour``): a value is
written at once; an ``Offload`` or a ``Wait`` (a Free/Fork of a sequence with a copy in flight) is a ``Pending``
that makes the record a ``Deferred``, settled on the event loop while the serving thread goes on with the other channels; its reply is
written once it has settled (``FastPathServer``). A Free that may take more than one lock hold is a ``Deferred``
from the start: made on the loop, its chunks are released one loop callback each, as on gRPC.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from kvpool import fastpath as fp
from kvpool import fastpath_codec as codec
from kvpool_server.core import InvalidArgumentError
from kvpool_server.service.errors import Code, ServerShuttingDownError, Status
from kvpool_server.service.freeing import may_chunk
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.fastpath import register_many, step
from kvpool_server.fastpath.channel import ChannelHeaders as ChannelHeaders  # a record's headers, per channel
from kvpool_server.service.register_batch import RegisteredPrompt
from kvpool_server.service import answers
from kvpool_server.service.answers import Pending
from kvpool_server.service.scope import Call, CallScope

U64 = (1 << 64) - 1


class Deferred:
    """A record whose answer is not final yet (``pending``: the adapter's ``Pending`` -- an Offload, a Wait, or a
    call made on the loop from the start): its call scope stays open until ``settle`` (on the event loop) has the
    final answer -- or the exception, whose status is then ``call.status``."""

    __slots__ = ("call", "op", "pending", "answer", "failed", "block_size")

    def __init__(self, call: Call, op: int, pending: Pending, block_size: int) -> None:
        self.call, self.op, self.pending, self.block_size = call, op, pending, block_size
        self.answer: Any = None
        self.failed = False

    async def settle(self, executor: Any) -> None:
        try:
            answer = await self.pending.settle(executor)
        except BaseException as exc:
            self.failed = True
            self.call.__exit__(type(exc), exc, None)
            if not isinstance(exc, Exception):
                raise
            return
        self.answer = answer
        self.call.__exit__(None, None, None)

    def start(self, loop: asyncio.AbstractEventLoop | None, executor: Any,
              settled: Callable[[], None]) -> concurrent.futures.Future:
        """Settle on the event loop (``settled()`` is called once done, on the loop); the future says when. A
        loop that has closed (shutdown) refuses the record, as gRPC's calls are then."""
        settling = self.settle(executor)
        try:
            if loop is None:
                raise RuntimeError("no event loop")
            future = asyncio.run_coroutine_threadsafe(settling, loop)
        except RuntimeError:
            settling.close()  # never to be awaited, nor the Wait's
            self.pending.close()
            exc = ServerShuttingDownError("kvpool-server is shutting down")
            self.failed = True
            self.call.__exit__(type(exc), exc, None)
            future = concurrent.futures.Future()
            future.set_result(None)
            return future
        future.add_done_callback(lambda _: settled())
        return future

    def write(self, views: fp.Views, seq: int) -> None:
        """The settled answer's reply (the serving thread, once ``settle`` has ended)."""
        if self.failed:
            write_error(views, seq, self.call.status)
        else:
            write_answer(views, seq, self.op, self.answer, self.block_size)


def serve_record(service: KVPoolService, scope: CallScope, views: fp.Views, headers: ChannelHeaders,
                 session_id: int, generation: int, seq: int, prepared: Any = None) -> Deferred | None:
    """Serve the request record ``seq`` of a channel: its reply is written (None), or it is a ``Deferred`` to
    settle on the event loop. Raises only for a bug of ours (the caller then answers INTERNAL, never again).
    ``prepared``: the record as ``fair_channels`` copied it out, its prompt hashed (``Prepared``)."""
    header = codec.request_header(views) if prepared is None else prepared.header  # one copy: it cannot change
    op = header[fp.REQ_OP]
    call = scope.call(fp.OP_NAMES.get(op, "FastPath"), headers)
    try:
        call.__enter__()
    except Exception:  # refused by admission or authentication (its status is set)
        write_error(views, seq, call.status)
        return None
    try:
        if header[fp.REQ_SEQ] != seq or header[fp.REQ_GENERATION] != generation:
            raise InvalidArgumentError(
                f"fast path: a record for seq {header[fp.REQ_SEQ]} generation {header[fp.REQ_GENERATION]}; this "
                f"channel serves seq {seq} of generation {generation}")
        invoke, on_loop = _invocation(service, call, views, header, op, session_id, prepared)
        answer = answers.honour(invoke, _same, on_loop=on_loop)  # the one adapter, as gRPC's
    except BaseException as exc:
        call.__exit__(type(exc), exc, None)
        if not isinstance(exc, Exception):
            raise
        write_error(views, seq, call.status)
        return None
    block_size = service.guard.manager.block_size
    if isinstance(answer, answers.Pending):
        return Deferred(call, op, answer, block_size)
    call.__exit__(None, None, None)
    write_answer(views, seq, op, answer, block_size)
    return None


def _arrays(views: fp.Views, header: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes]:
    """The request's arrays, checked against the area and copied out of it (the codec's), or INVALID_ARGUMENT."""
    try:
        return codec.request_arrays(views, header)
    except codec.RecordTooBig as exc:
        raise InvalidArgumentError(str(exc)) from None


def _invocation(service: KVPoolService, call: Any, views: fp.Views, header: list[int], op: int,
                session_id: int, prepared: Any = None) -> tuple[Any, bool]:
    """The record as a call of the service (checked, its arrays copied out) -- ``invoke()`` may be called again,
    on the event loop, after a Wait -- and whether to call it on the loop from the start: a Free that may be
    released in chunks (``service.freeing``) releases them one loop callback each, as on gRPC (off the loop they
    would all go in one lock hold)."""
    ids, counts, tokens, extra = _arrays(views, header) if prepared is None else prepared.arrays
    request_id = header[fp.REQ_REQUEST_ID] & U64
    arg0, arg1 = header[fp.REQ_ARG0] & U64, header[fp.REQ_ARG1]
    if op == fp.OP_APPEND:
        n, n_counts = ids.size, counts.size
        count_arg: Any = counts
        if n_counts == 1:  # one count for all (the decode step): a Python int, as gRPC's single num_tokens
            one = int(counts[0])
            total, count_arg = one * n, [one]
        else:
            total = n if not n_counts else int(counts.sum())
        if (n_counts <= 1 or n_counts == n) and \
                fp.append_reply_bound(n, total, service.guard.manager.block_size) > views.area_bytes:
            raise InvalidArgumentError(f"fast path: the reply of an append of {total} tokens to {n} sequences may "
                                       f"not fit the {views.area_bytes}-byte reply area: send it over gRPC")
        return lambda: service.append(call, cast(Any, ids), count_arg, cast(Any, tokens), session_id,
                                      request_id), False
    if op == fp.OP_REGISTER:
        if arg1 < 0:
            raise InvalidArgumentError(f"RegisterSequence public_prefix_len must be >= 0, got {arg1}")
        hashes = None if prepared is None else prepared.hashes[0]
        return lambda: service.register(call, arg0 or None, session_id, request_id, cast(Any, tokens), arg1,
                                        extra, hashes), False
    if op == fp.OP_REGISTER_MANY:
        prompts = register_many.prompts_of(service, views.area_bytes, (ids, counts, tokens, extra))
        many_hashes = None if prepared is None else prepared.hashes
        return lambda: service.register_many(call, prompts, session_id, request_id, many_hashes), False
    if op == fp.OP_STEP:
        return step.invocation(service, call, views.area_bytes, (ids, counts, tokens, extra), header, session_id,
                               None if prepared is None else prepared.hashes)
    if op == fp.OP_FORK:
        if not 0 <= arg1 <= service.max_batch:
            raise InvalidArgumentError(f"Fork num_children must be in [0, max_batch={service.max_batch}], got {arg1}")
        if fp.reply_bytes(0, 0, 0, 0, max(arg1, ids.size)) > views.area_bytes:
            raise InvalidArgumentError("fast path: the Fork's reply does not fit the reply area: use gRPC")
        children = ids.tolist()
        return lambda: service.fork(call, arg0, arg1, children, session_id, request_id), False
    if op == fp.OP_FREE:
        id_list = ids.tolist()
        return lambda: service.free(call, id_list, session_id, request_id), may_chunk(service.guard.manager, len(id_list))
    raise InvalidArgumentError(f"fast path: unknown op {op}")


def _same(answer: Any) -> Any:
    return answer


def write_answer(views: fp.Views, seq: int, op: int, answer: Any, block_size: int) -> None:
    """An OK reply. Its size is checked before anything is written: a reply that would not fit raises (a bug of
    ours: the bounds checked before the call should have refused it) and leaves the area as it was."""
    if op == fp.OP_APPEND:  # the decode step's: first
        slots, new, copies = answer.slot_mapping, answer.new_block_ids, answer.copies
        needed = fp.HEADER_BYTES + 8 * slots.size + ((4 * new.size + 7) & ~7) + 8 * copies.shape[0]  # reply_bytes
        if needed > views.area_bytes:
            raise AssertionError(f"kvpool bug: an append's reply of {needed} bytes passed its bound "
                                 f"(area {views.area_bytes})")
        codec.write_append_reply(views, slots, new, copies)
    elif op == fp.OP_REGISTER_MANY:
        register_many.write_reply(views, block_size, answer)
    elif op == fp.OP_STEP:
        step.write_reply(views, answer)
    elif op == fp.OP_FORK:
        children = np.asarray(answer, dtype=np.uint64)
        if fp.reply_bytes(0, 0, 0, 0, children.size) > views.area_bytes:
            raise AssertionError(f"kvpool bug: a Fork's reply of {children.size} children passed its bound")
        codec.write_children_reply(views, children)
    elif isinstance(answer, RegisteredPrompt):
        blocks = answer.cached_block_ids
        if fp.reply_bytes(0, 0, blocks.size, 0, 0) > views.area_bytes:  # a prompt's request holds 4 bytes a token
            raise AssertionError(f"kvpool bug: a register's reply of {blocks.size} block ids passed its bound")
        codec.write_registered_reply(views, answer.seq_id, answer.num_cached_tokens, blocks)
    elif isinstance(answer, (int, np.integer)):
        codec.write_values_reply(views, int(answer))
    else:
        raise AssertionError(f"kvpool bug: the fast path has no reply for a {type(answer).__name__} answer")
    codec.publish_reply(views, seq)


def write_error(views: fp.Views, seq: int, status: Status) -> None:
    codec.write_error_reply(views, int(status.code) or int(Code.INTERNAL), status.reason, status.message)
    codec.publish_reply(views, seq)  # an error reply never reads as OK: its code is never 0


def write_bug(views: fp.Views, seq: int, exc: BaseException) -> None:
    """The reply of a record whose serving raised (a bug of ours): INTERNAL -- whether or not it was applied, it
    is answered, and never served again."""
    write_error(views, seq, Status(Code.INTERNAL, f"kvpool bug on the fast path: {type(exc).__name__}: {exc}"))
