"""The step record (``OP_STEP``): a Free, an AppendToken and a RegisterSequences in one record -- a scheduler's
whole step (docs/fast-path.md; the layout is ``kvpool.fastpath_step``'s).

    record    split (``split_step``: counts that do not match the arrays are INVALID_ARGUMENT, nothing applied); a
              request_id is refused (a channel applies a record at most once: its parts are never replayed); the
              reply's bound checked against the reply area (INVALID_ARGUMENT, nothing applied)
    parts     ``service/step.py``: the Free, then the AppendToken, then the RegisterSequences, each by the service
              method of its own call (same checks, statuses and messages, each all or none); a part that fails gets
              its status and the parts after it still run
    reply     OK, with each part's status and an OK part's answer (``write_reply``)

A Free that may take more than one lock hold makes the record a call on the event loop from the start (as a Free
record is); the step's Wait and Offload are the one adapter's (``answers.honour``), as any service answer. The
register part's prompts are hashed on the hasher when long, as a register-many record's (``fair_channels``):
``hashes``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool import fastpath as fp
from kvpool import fastpath_codec as codec
from kvpool import fastpath_step as step_codec
from kvpool_server.core import InvalidArgumentError
from kvpool_server.fastpath import register_many
from kvpool_server.service import step as service_step
from kvpool_server.service.freeing import may_chunk
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.scope import Call

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, bytes]


def parts_of(arrays: Arrays, header: list[int]) -> step_codec.StepParts:
    """The record's parts, or INVALID_ARGUMENT."""
    if header[fp.REQ_REQUEST_ID]:
        raise InvalidArgumentError("fast path: a Step record carries no request_id (a channel applies a record at "
                                   "most once; its parts are never replayed)")
    try:
        return step_codec.split_step(*arrays, header[fp.REQ_ARG0], header[fp.REQ_ARG1])
    except codec.RecordInconsistent as exc:
        raise InvalidArgumentError(str(exc)) from None


def register_arrays(arrays: Arrays, header: list[int]) -> Arrays | None:
    """The record's register part as a register-many record's arrays (for its hashing), None when it has none
    or the record is refused."""
    try:
        register = parts_of(arrays, header).register
    except InvalidArgumentError:
        return None
    return register if register[0].size else None


def invocation(service: KVPoolService, call: Call, area_bytes: int, arrays: Arrays, header: list[int],
               session_id: int, hashes: Any = None) -> tuple[Callable[[], Any], bool]:
    """The record as its three parts' calls (``invoke()`` may be called again, on the loop, after a Wait), and
    whether to call it on the loop from the start (a Free that may be released in chunks)."""
    parts = parts_of(arrays, header)
    bs = service.guard.manager.block_size
    n_append, appended = parts.append_ids.size, int(parts.append_counts.sum())
    key_lens, counts = parts.register[0], parts.register[1]
    n_prompts = key_lens.size
    prompt_blocks = int((np.maximum(counts[:n_prompts] - 1, 0) // bs).sum())  # (t - 1) // bs at most each
    if step_codec.step_reply_bytes(n_append, appended, n_prompts, prompt_blocks, bs) > area_bytes:
        raise InvalidArgumentError(f"fast path: the reply of a Step of {n_append} appends ({appended} tokens) and "
                                   f"{n_prompts} prompts may not fit the {area_bytes}-byte reply area: make the "
                                   "calls one by one")
    free_ids = parts.free_ids.tolist()
    append = None if not n_append else (parts.append_ids, parts.append_counts,
                                        () if parts.append_tokens is None else parts.append_tokens)
    prompts = None if not n_prompts else (lambda: register_many.split(service, parts.register))  # --max-batch first
    return (lambda: service_step.step(service, call, session_id, free_ids, append, prompts, hashes),
            may_chunk(service.guard.manager, len(free_ids)))


def write_reply(views: fp.Views, answer: service_step.StepAnswer) -> None:
    """The OK reply of a step. Its size is checked before anything is written (a bug of ours if it does not fit:
    ``invocation`` checked the bound)."""
    plan, registered = answer.append, answer.register
    append = None if plan is None else (plan.slot_mapping, plan.new_block_ids, plan.copies)
    register = None
    n_slots = n_new = n_copies = n_prompts = n_blocks = 0
    if plan is not None:
        n_slots, n_new, n_copies = plan.slot_mapping.size, plan.new_block_ids.size, plan.copies.shape[0]
    if registered is not None:
        blocks = [r.cached_block_ids for r in registered]
        flat = np.concatenate(blocks) if blocks else np.zeros(0, np.int32)
        register = (answer.block_size, [r.seq_id for r in registered], [r.num_cached_tokens for r in registered],
                    flat)
        n_prompts, n_blocks = len(registered), flat.size
    needed = (fp.HEADER_BYTES + 8 * step_codec.TABLE_WORDS + 3 * step_codec.PART_MESSAGE_BYTES +
              fp.reply_bytes(0, n_slots, n_new, n_copies, 0) + fp.register_many_reply_bytes(n_prompts, n_blocks) -
              2 * fp.HEADER_BYTES)
    if needed > views.area_bytes:
        raise AssertionError(f"kvpool bug: a Step's reply of {needed} bytes passed its bound (area "
                             f"{views.area_bytes})")
    statuses = [(int(s.code), fp.REASONS.index(s.reason) if s.reason in fp.REASONS else 0, s.message)
                for s in answer.statuses]
    step_codec.write_step_reply(views, statuses, answer.freed, append, register)
