"""``step``: a Free, an AppendToken and a RegisterSequences -- a scheduler's step -- in one round trip.

    result = client.step(free=[7, 9], append=([3, 4], [33, 1], token_ids), register=(prompts, keys))
    result.freed, result.appended, result.registered     # each: its answer, its error, or None (not asked)

Over the fast path (fast_commands.py) it is one step record (``kvpool.fastpath_step``), whose parts the server
serves in order, each by the service method of its own call; over gRPC (a remote server, a record too big for
the channel, a server that does not know the record) the same three calls, one after the other (``separate``).
Either way each part is answered as its own call would be: all or none, its own status; a part the server refuses
is that part's error and the parts after it are still made. A failure of the transport itself (UNAVAILABLE, a
deadline, a cancellation) raises, as any call does: what it applied is then unknown, the connection's state is.
Nothing is sent again: the record is applied at most once (a channel never resends), and over gRPC each call
retries as it does alone (its session's request_id).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvpool import fastpath as fp
from kvpool import fastpath_step as step_codec
from kvpool.fastpath_codec import write_request
from kvpool_client import fast_args
from kvpool_client.errors import CancelledError, DeadlineExceededError, KVPoolClientError, UnavailableError
from kvpool_client.plan import Plan
from kvpool_client.types import AppendResult, RegisteredSequence, StepResult

METHOD = "Step"
TRANSPORT_ERRORS = (UnavailableError, DeadlineExceededError, CancelledError)
MAX_EXTRA_KEY = 4096

Append = tuple[Sequence[int], Sequence[int], Sequence[int] | None]  # seq ids, counts one each, token ids
Register = tuple[Sequence[Sequence[int] | np.ndarray], Sequence[bytes]]  # prompts, a key each (or none)


class StepRecord(NamedTuple):
    """A step's arguments as the record's arrays (``step_codec.step_arrays``) and what reading the reply needs."""

    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, bytes, int, int]
    append_ids: tuple[int, ...]
    append_counts: np.ndarray
    need: tuple[int, int, int, int, int]  # ids, counts, tokens, extra bytes, worst-case reply


def record_of(free: Sequence[int], append: Append | None, register: Register | None) -> StepRecord | None:
    """The step as a record, or None for anything the record cannot carry (the calls then go one by one, and
    each gives its own error)."""
    free_ids = list(free)
    if not fast_args.uint64_ok(free_ids):
        return None
    append_ids, counts, tokens, total = (), np.zeros(0, np.int64), None, 0
    if append is not None:
        args = fast_args.append_args(append[0], append[1])
        if args is None:
            return None
        append_ids, counts, total = args[0], args[2], args[4]
        if append[2] is not None:
            tokens = fast_args.uint32_tokens(append[2])
            if tokens is None or tokens.size != total:
                return None
    prompts: list[np.ndarray] = []
    keys: list[bytes] = []
    if register is not None:
        converted = [fast_args.uint32_tokens(p) for p in register[0]]
        keys = list(register[1]) or [b""] * len(converted)
        if not converted or any(p is None or not p.size for p in converted) or len(keys) != len(converted) or \
                any(len(k) > MAX_EXTRA_KEY for k in keys):
            return None
        prompts = [p for p in converted if p is not None]
    arrays = step_codec.step_arrays(np.asarray(free_ids, np.uint64), np.asarray(append_ids, np.uint64), counts,
                                    tokens, prompts, keys)
    prompt_tokens = sum(p.size for p in prompts)
    reply = step_codec.step_reply_bytes(len(append_ids), total, len(prompts), prompt_tokens)  # block size 1: the most
    need = (arrays[0].size, arrays[1].size, arrays[2].size, len(arrays[3]), reply)
    return StepRecord(arrays, tuple(append_ids), counts, need)


def writer(generation: int, record: StepRecord) -> Any:
    ids, counts, tokens, extra, n_free, n_append = record.arrays
    return lambda views: write_request(views, fp.OP_STEP, 0, generation, ids=ids, counts=counts, tokens=tokens,
                                       extra=extra, arg0=n_free, arg1=n_append)


def reader(record: StepRecord, free: bool, append: bool, register: bool, error_for: Any) -> Any:
    """The reply as a StepResult (``error_for(code, message, reason, method)``: a refused part's error)."""

    def read(views: fp.Views) -> StepResult:
        reply = step_codec.read_step_reply(views)
        answers: list[Any] = [None, None, None]
        for i, (asked, (code, reason, message)) in enumerate(zip((free, append, register), reply.statuses)):
            if asked and code:
                answers[i] = error_for(code, message, reason, step_codec.PARTS[i])
        if free and answers[0] is None:
            answers[0] = reply.freed
        if append and answers[1] is None:
            slots, new, copies = reply.append
            answers[1] = AppendResult(seq_ids=record.append_ids, num_tokens=record.append_counts,
                                      slot_mapping=slots, new_block_ids=new, copies=copies)
        if register and answers[2] is None:
            answers[2] = [RegisteredSequence(s, c, b) for s, c, b in reply.register]
        return StepResult(*answers)

    return read


def separate(commands: Any, free: Sequence[int], append: Append | None, register: Register | None,
             timeout: float | None) -> Plan[StepResult]:
    """The step as its three calls, one after the other (each over the fast path where it can go alone): a
    refusal is that part's answer; a transport failure raises."""
    answers: list[Any] = [None, None, None]
    cls = type(commands)
    calls = []
    if len(free):
        calls.append((0, lambda: cls.free.__wrapped__(commands, list(free), timeout=timeout)))
    if append is not None:
        calls.append((1, lambda: cls.append.__wrapped__(commands, append[0], append[1], token_ids=append[2],
                                                        timeout=timeout)))
    if register is not None:
        calls.append((2, lambda: cls.register_prompts.__wrapped__(commands, register[0],
                                                                  cache_extra_keys=register[1], timeout=timeout)))
    for i, plan in calls:
        try:
            answers[i] = yield from plan()
        except TRANSPORT_ERRORS:
            raise
        except KVPoolClientError as error:
            answers[i] = error
    return StepResult(*answers)
