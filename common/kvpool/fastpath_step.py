"""The step record (``OP_STEP``): a Free, an AppendToken and a RegisterSequences in one fast-path record -- a
scheduler's whole step in one round trip. The one definition of its layout, both sides' (the server in
kvpool_server/fastpath/step.py, the client in kvpool_client/fast_step.py); docs/fast-path.md has the picture.

    request   ARG0 = F, the Free's ids; ARG1 = A, the append's ids; the other R = n_ids - F - A ids are the
              register's key lengths
              ids     the Free's seq ids (F), the append's seq ids (A), each prompt's cache_extra_key length (R)
              counts  the append's token counts, one a sequence (A); each prompt's token count (R); each prompt's
                      public_prefix_len (R)
              tokens  the append's token ids (none, or one a token appended), then the prompts concatenated
              extra   the keys concatenated
    reply     OK (the record as a whole; an error reply: nothing of it applied), then its arrays:
              parts   16 int64 words: per part (free, append, register) its status code, reason index and
                      message length, then free: blocks freed; append: slots, new block ids, copies; register:
                      the block size, the prompts answered, their cached block ids in all
              messages  the three parts' messages (utf-8, each cut to PART_MESSAGE_BYTES, 8-aligned)
              append    slots int64, new block ids int32 (8-aligned), copies int32 [c, 2]   (an OK append's)
              register  cached counts int64, cached block ids int32 (8-aligned), seq ids uint64  (an OK one's)

A part that is absent (no ids) is answered OK with nothing. The codec checks only what a reader must check before
it reads: ``split_step`` that the counts match the arrays (``RecordInconsistent``); the server checks the rest.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvpool import fastpath as fp
from kvpool.fastpath_codec import RecordInconsistent, read_registered, register_many_arrays, split_register_many

PART_MESSAGE_BYTES = 1024
PARTS = ("Free", "AppendToken", "RegisterSequences")
TABLE_WORDS = 16
FREE, APPEND, REGISTER = 0, 4, 10  # the parts' first words in the table: code, reason, message length, ...


class StepParts(NamedTuple):
    """A step record's three parts as its arrays: the Free's ids; the append's ids, counts and token ids (None:
    none sent); the register's arrays (``split_register_many``'s input) -- each part empty when absent."""

    free_ids: np.ndarray
    append_ids: np.ndarray
    append_counts: np.ndarray
    append_tokens: np.ndarray | None
    register: tuple[np.ndarray, np.ndarray, np.ndarray, bytes]


def step_arrays(free_ids: np.ndarray, append_ids: np.ndarray, append_counts: np.ndarray,
                append_tokens: np.ndarray | None, prompts: list[np.ndarray],
                keys: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes, int, int]:
    """The record's arrays (ids, counts, tokens, extra) and its two header args, for ``write_request``."""
    key_lens, reg_counts, reg_tokens, extra = register_many_arrays(prompts, keys, [0] * len(prompts))
    ids = np.concatenate([free_ids.astype(np.uint64, copy=False), append_ids.astype(np.uint64, copy=False), key_lens])
    counts = np.concatenate([append_counts.astype(np.uint32, copy=False), reg_counts])
    tokens = reg_tokens if append_tokens is None else np.concatenate([append_tokens.astype(np.uint32, copy=False),
                                                                      reg_tokens])
    return ids, counts, tokens, extra, free_ids.size, append_ids.size


def split_step(ids: np.ndarray, counts: np.ndarray, tokens: np.ndarray, extra: bytes, n_free: int,
               n_append: int) -> StepParts:
    """A step record's arrays (as ``request_arrays`` copied them) as its parts, or ``RecordInconsistent``: the
    header's F and A past the ids, counts not ``A + 2R``, the prompts' token counts past the tokens, the append's
    token ids neither none nor one a token appended, the key lengths not summing to the extra bytes (checked
    again by ``split_register_many``)."""
    if not (0 <= n_free <= ids.size and 0 <= n_append <= ids.size - n_free):
        raise RecordInconsistent(f"fast path: a Step record of {ids.size} ids names {n_free} to free and "
                                 f"{n_append} to append")
    n_prompts = ids.size - n_free - n_append
    if counts.size != n_append + 2 * n_prompts:
        raise RecordInconsistent(f"fast path: a Step record of {n_append} appended sequences and {n_prompts} "
                                 f"prompts needs {n_append + 2 * n_prompts} counts, got {counts.size}")
    append_counts = counts[:n_append]
    prompt_tokens = sum(counts[n_append:n_append + n_prompts].tolist())  # Python ints: no sum wraps
    appended = tokens.size - prompt_tokens
    if appended not in (0, sum(append_counts.tolist())) or n_append == 0 and appended:
        raise RecordInconsistent(f"fast path: a Step record's tokens ({tokens.size}) are neither its prompts' "
                                 f"({prompt_tokens}) nor those and one token id a token appended")
    register = (ids[n_free + n_append:], counts[n_append:], tokens[appended:], extra)
    if n_prompts:
        split_register_many(*register)  # its own consistency (RecordInconsistent)
    elif extra:
        raise RecordInconsistent(f"fast path: a Step record with no prompt carries {len(extra)} key bytes")
    return StepParts(ids[:n_free], ids[n_free:n_free + n_append], append_counts,
                     tokens[:appended] if appended else None, register)


def step_reply_bytes(n_append: int, n_appended: int, n_prompts: int, n_prompt_blocks: int,
                     block_size: int = 1) -> int:
    """The largest reply a step record can have: the table, three messages, an append's reply and a register's
    (each without its header)."""
    append = fp.append_reply_bound(n_append, n_appended, block_size) - fp.HEADER_BYTES if n_append else 0
    register = fp.register_many_reply_bytes(n_prompts, n_prompt_blocks) - fp.HEADER_BYTES if n_prompts else 0
    return fp.HEADER_BYTES + 8 * TABLE_WORDS + 3 * PART_MESSAGE_BYTES + append + register


# ---------------------------------------------------------------- the reply: the server writes
def write_step_reply(views: fp.Views, statuses: list[tuple[int, int, str]], freed: int,
                     append: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
                     register: tuple[int, list[int], list[int], np.ndarray] | None) -> None:
    """An OK step reply: each part's (code, reason index, message), the blocks freed, an OK append's (slots, new,
    copies), an OK register's (block size, seq ids, cached counts, cached blocks). The caller has checked that it
    fits (``step_reply_bytes``)."""
    rep, area = views.rep, views.rep_area
    table = np.zeros(TABLE_WORDS, np.int64)
    at = fp.HEADER_BYTES + 8 * TABLE_WORDS
    for part, (code, reason, message) in zip((FREE, APPEND, REGISTER), statuses):
        data = message.encode("utf-8", "replace")[:PART_MESSAGE_BYTES]
        area[at:at + len(data)] = np.frombuffer(data, np.uint8)
        at += fp.align8(len(data))
        table[part:part + 3] = code, reason, len(data)
    table[FREE + 3] = freed
    if append is not None:
        slots, new, copies = append
        table[APPEND + 3:APPEND + 6] = slots.size, new.size, copies.shape[0]
        area[at:at + 8 * slots.size].view(np.int64)[:] = slots
        at += 8 * slots.size
        area[at:at + 4 * new.size].view(np.int32)[:] = new
        at += fp.align8(4 * new.size)
        area[at:at + 8 * copies.shape[0]].view(np.int32)[:] = copies.reshape(-1)
        at += 8 * copies.shape[0]
    if register is not None:
        block_size, seq_ids, cached, blocks = register
        n = len(seq_ids)
        table[REGISTER + 3:REGISTER + 6] = block_size, n, blocks.size
        area[at:at + 8 * n].view(np.int64)[:] = cached
        at += 8 * n
        area[at:at + 4 * blocks.size].view(np.int32)[:] = blocks
        at += fp.align8(4 * blocks.size)
        area[at:at + 8 * n].view(np.uint64)[:] = seq_ids
    area[fp.HEADER_BYTES:fp.HEADER_BYTES + 8 * TABLE_WORDS].view(np.int64)[:] = table
    rep[fp.REP_CODE:fp.REP_MSG_LEN + 1] = 0
    rep[fp.REP_N_SLOTS] = rep[fp.REP_N_NEW] = rep[fp.REP_N_COPIES] = rep[fp.REP_N_CHILDREN] = 0


# ---------------------------------------------------------------- the reply: the client reads
class StepReply(NamedTuple):
    """A step reply as read: each part's (code, reason index, message) -- code 0: OK -- and its answer."""

    statuses: list[tuple[int, int, str]]
    freed: int
    append: tuple[np.ndarray, np.ndarray, np.ndarray]  # slots, new block ids, copies [c, 2] (int64 each, copies)
    register: list[tuple[int, int, np.ndarray]]  # (seq_id, num_cached_tokens, cached block ids int32) a prompt


def read_step_reply(views: fp.Views) -> StepReply:
    area = views.rep_area
    cap = area.size
    table = area[fp.HEADER_BYTES:fp.HEADER_BYTES + 8 * TABLE_WORDS].view(np.int64).tolist()
    at = fp.HEADER_BYTES + 8 * TABLE_WORDS
    statuses = []
    for part in (FREE, APPEND, REGISTER):
        n = min(max(table[part + 2], 0), PART_MESSAGE_BYTES)
        statuses.append((table[part], table[part + 1], area[at:at + n].tobytes().decode("utf-8", "replace")))
        at += fp.align8(n)
    n_slots, n_new, n_copies = (min(max(v, 0), cap) for v in table[APPEND + 3:APPEND + 6])
    slots = area[at:at + 8 * n_slots].view(np.int64).copy()
    at += 8 * n_slots
    new = area[at:at + 4 * n_new].view(np.int32).astype(np.int64)
    at += fp.align8(4 * n_new)
    copies = area[at:at + 8 * n_copies].view(np.int32).astype(np.int64).reshape(-1, 2)
    at += 8 * n_copies
    block_size, n, n_blocks = table[REGISTER + 3], min(max(table[REGISTER + 4], 0), cap), min(max(table[REGISTER + 5], 0), cap)
    register = read_registered(area, at, block_size, n, n_blocks, n)
    return StepReply(statuses, table[FREE + 3], (slots, new, copies), register)
