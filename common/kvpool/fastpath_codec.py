"""The fast path's record codec: how a request and a reply record are written and read, the one definition both sides
use (the server in kvpool_server/fastpath/records.py, the client in kvpool_client/fastpath_records.py and
fastpath.py). The words and offsets are kvpool.fastpath's; docs/fast-path.md has the picture.

    request   write_request (client; register_many_arrays: N prompts as its arrays) -> publish_request (client)
              -> request_header, request_arrays (server; split_register_many: the arrays as N prompts again)
    reply     write_append_reply / write_children_reply / write_values_reply / write_registered_reply /
              write_registered_many_reply / write_error_reply (server) -> publish_reply (server) -> reply_error,
              read_append_reply, read_children, read_values, read_registered_reply, read_registered_many_reply
              (client)

What a side decides stays with it: the server's bounds (``append_reply_bound``, which error is whose status) and the
client's types. The codec checks only what a reader must check before it reads: a request's counts against its area
(``RecordTooBig``) and a register-many record's lengths against its arrays (``RecordInconsistent``); the server
trusts nothing it reads, so ``request_arrays`` copies the arrays out of the segment.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np

from kvpool import fastpath as fp

WRAP = 1 << 64  # a uint64 field is written as the int64 word with the same bits
_barrier = threading.Lock()
# Header words packed in one call (native int64, as NumPy's ``int64`` views read them): a request's words from
# REQ_OP to REQ_EXTRA_LEN; a reply's REP_CODE..REP_MSG_LEN and REP_N_SLOTS..REP_N_CHILDREN; a seq word
_REQUEST_WORDS = struct.Struct(f"{fp.REQ_SEQ}q")
_STATUS_WORDS = struct.Struct("3q")  # REP_CODE, REP_REASON, REP_MSG_LEN
_COUNT_WORDS = struct.Struct("4q")  # REP_N_SLOTS, REP_N_NEW, REP_N_COPIES, REP_N_CHILDREN
_WORD = struct.Struct("q")
_U32 = struct.Struct("I")


class RecordTooBig(ValueError):
    """A request whose counts pass its area: nothing of it is read."""


class RecordInconsistent(ValueError):
    """A register-many record whose lengths do not match its arrays: nothing of it is applied."""


def memory_barrier() -> None:
    """A full barrier between our store and our load of the other side's flag (an uncontended lock's atomic
    read-modify-write; x86 orders it fully). The parked side's timeout covers a platform where it would not."""
    _barrier.acquire()
    _barrier.release()


def _word(value: int) -> int:
    return value - WRAP if value >= 1 << 63 else value


# ---------------------------------------------------------------- requests
def write_request(views: fp.Views, op: int, request_id: int, generation: int, *, ids: Any = None, counts: Any = None,
                  tokens: Any = None, extra: bytes = b"", arg0: int = 0, arg1: int = 0) -> None:
    """Write a request record's arrays and header (not yet published): ``ids`` uint64, ``counts`` and ``tokens``
    uint32, ``extra`` bytes, each array on an 8-byte boundary after the header."""
    area = views.req_area
    n_ids = 0 if ids is None else ids.size
    n_counts = 0 if counts is None else counts.size
    n_tokens = 0 if tokens is None else tokens.size
    at = fp.HEADER_BYTES
    if n_ids:
        area[at:at + 8 * n_ids].view(np.uint64)[:] = ids
    at += 8 * n_ids
    if n_counts == 1 and counts.dtype == np.uint32:  # one count for all (the decode step's): packed
        _U32.pack_into(area.data, at, int(counts[0]))
    elif n_counts:
        area[at:at + 4 * n_counts].view(np.uint32)[:] = counts
    at += (4 * n_counts + 7) & ~7
    if n_tokens:
        area[at:at + 4 * n_tokens].view(np.uint32)[:] = tokens
    at += (4 * n_tokens + 7) & ~7
    if extra:
        area[at:at + len(extra)] = np.frombuffer(extra, np.uint8)
    words = (op, _word(request_id), generation, n_ids, n_counts, n_tokens, _word(arg0), arg1, len(extra))
    try:
        _REQUEST_WORDS.pack_into(views.req_words, 0, *words)
    except struct.error:  # not all int64s (a float, a value past int64): NumPy's conversion (and error), as before
        views.req[:fp.REQ_SEQ] = words


def register_many_arrays(prompts: list[np.ndarray], keys: list[bytes],
                         public_prefix_lens: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes]:
    """N prompts (uint32 each), their keys and public prefix lengths as a register-many record's arrays (ids,
    counts, tokens, extra: ``kvpool.fastpath``'s layout), for ``write_request``."""
    ids = np.fromiter((len(k) for k in keys), np.uint64, len(keys))
    counts = np.fromiter((p.size for p in prompts), np.uint32, len(prompts))
    counts = np.concatenate([counts, np.asarray(public_prefix_lens, dtype=np.uint32)])
    tokens = np.concatenate(prompts) if prompts else np.zeros(0, np.uint32)
    return ids, counts, tokens.astype(np.uint32, copy=False), b"".join(keys)


def split_register_many(ids: np.ndarray, counts: np.ndarray, tokens: np.ndarray,
                        extra: bytes) -> list[tuple[np.ndarray, int, bytes]]:
    """A register-many record's arrays (as ``request_arrays`` copied them) as its prompts: (token ids, a view of
    ``tokens``; public_prefix_len; cache_extra_key) each. ``RecordInconsistent`` unless there are two counts a key
    length, the token counts sum to the tokens and the key lengths to the extra bytes."""
    n = ids.size
    if counts.size != 2 * n:
        raise RecordInconsistent(f"fast path: a RegisterSequences record of {n} key lengths needs {2 * n} counts "
                                 f"(each prompt's token count, then its public_prefix_len), got {counts.size}")
    values, key_lens = counts.tolist(), ids.tolist()  # Python ints: no sum wraps
    if sum(values[:n]) != tokens.size:
        raise RecordInconsistent(f"fast path: a RegisterSequences record's token counts sum to {sum(values[:n])}, "
                                 f"its tokens are {tokens.size}")
    if sum(key_lens) != len(extra):
        raise RecordInconsistent(f"fast path: a RegisterSequences record's key lengths sum to {sum(key_lens)}, its "
                                 f"key bytes are {len(extra)}")
    out, at, key_at = [], 0, 0
    for i in range(n):
        end, key_end = at + values[i], key_at + key_lens[i]
        out.append((tokens[at:end], values[n + i], extra[key_at:key_end]))
        at, key_at = end, key_end
    return out


def publish_request(views: fp.Views, seq: int) -> None:
    """Publish the written request as ``seq``: its seq word, then (after the barrier) ``CTL_REQ_SEQ``."""
    views.req_words[fp.REQ_SEQ] = seq
    memory_barrier()  # the record's stores before the seq's (x86 keeps them in order anyway; ARM does not)
    views.ctl[fp.CTL_REQ_SEQ] = seq


def request_header(views: fp.Views) -> list[int]:
    """The request's header words as Python ints: one copy, so that it cannot change under its reader."""
    memory_barrier()  # the record's loads after the seq's
    return views.req.tolist()


def request_arrays(views: fp.Views, header: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes]:
    """The request's arrays (ids uint64, counts int64, tokens uint32, extra bytes), their counts checked against the
    area (``RecordTooBig``) and copied out of it: one copy of the record's bytes, the arrays views of that copy
    (never of the segment)."""
    area = views.area_bytes
    n_ids, n_counts, n_tokens, extra = (header[fp.REQ_N_IDS], header[fp.REQ_N_COUNTS], header[fp.REQ_N_TOKENS],
                                        header[fp.REQ_EXTRA_LEN])
    counts_at = 8 * n_ids  # offsets in the copy, which starts after the header
    tokens_at = counts_at + ((4 * n_counts + 7) & ~7)
    extra_at = tokens_at + ((4 * n_tokens + 7) & ~7)
    end = extra_at + extra
    if not (0 <= n_ids <= area and 0 <= n_counts <= area and 0 <= n_tokens <= area and 0 <= extra <= area) or \
            fp.HEADER_BYTES + extra_at + ((extra + 7) & ~7) > area:  # fp.request_bytes, inline
        raise RecordTooBig(f"fast path: a request of {n_ids} ids, {n_counts} counts, {n_tokens} tokens and "
                           f"{extra} key bytes does not fit the {area}-byte request area")
    data = views.req_area[fp.HEADER_BYTES:fp.HEADER_BYTES + end].copy()  # 8-aligned: each array's view is too
    ids = data[:counts_at].view(np.uint64)
    if n_counts == 1:  # one count for all (the decode step's): read as an int, not through a uint32 view
        counts = np.array(_U32.unpack_from(data.data, counts_at), dtype=np.int64)
    else:
        counts = data[counts_at:counts_at + 4 * n_counts].view(np.uint32).astype(np.int64)
    tokens = data[tokens_at:tokens_at + 4 * n_tokens].view(np.uint32) if n_tokens else np.empty(0, np.uint32)
    return ids, counts, tokens, data[extra_at:end].tobytes() if extra else b""


# ---------------------------------------------------------------- replies: the server writes
def write_append_reply(views: fp.Views, slots: np.ndarray, new: np.ndarray, copies: np.ndarray) -> None:
    """An OK append reply: slots int64, new block ids int32, copies int32 [c, 2]. The caller has checked that it
    fits (``fp.reply_bytes``)."""
    area, words = views.rep_area, views.rep_words
    n_slots, n_new, n_copies = slots.size, new.size, copies.shape[0]
    _STATUS_WORDS.pack_into(words, 8 * fp.REP_CODE, 0, 0, 0)  # code, reason, message length
    at = fp.HEADER_BYTES
    area[at:at + 8 * n_slots].view(np.int64)[:] = slots
    at += 8 * n_slots
    if n_new:
        area[at:at + 4 * n_new].view(np.int32)[:] = new
        at += (4 * n_new + 7) & ~7
    if n_copies:
        area[at:at + 8 * n_copies].view(np.int32)[:] = copies.reshape(-1)
    _COUNT_WORDS.pack_into(words, 8 * fp.REP_N_SLOTS, n_slots, n_new, n_copies, 0)


def write_children_reply(views: fp.Views, children: np.ndarray) -> None:
    """An OK Fork reply: the children's ids, uint64. The caller has checked that it fits."""
    rep = views.rep
    rep[fp.REP_CODE:fp.REP_MSG_LEN + 1] = 0
    views.rep_area[fp.HEADER_BYTES:fp.HEADER_BYTES + 8 * children.size].view(np.uint64)[:] = children
    rep[fp.REP_N_SLOTS] = rep[fp.REP_N_NEW] = rep[fp.REP_N_COPIES] = 0
    rep[fp.REP_N_CHILDREN] = children.size


def write_values_reply(views: fp.Views, value0: int, value1: int = 0) -> None:
    """An OK reply of two values (register: seq_id as its int64 bits, num_cached_tokens; free: blocks freed)."""
    rep = views.rep
    rep[fp.REP_CODE:fp.REP_MSG_LEN + 1] = 0
    rep[fp.REP_VALUE0], rep[fp.REP_VALUE1] = _word(value0), value1
    rep[fp.REP_N_SLOTS] = rep[fp.REP_N_NEW] = rep[fp.REP_N_COPIES] = rep[fp.REP_N_CHILDREN] = 0


def write_registered_reply(views: fp.Views, seq_id: int, num_cached_tokens: int, block_ids: np.ndarray) -> None:
    """An OK register reply: the seq_id (its int64 bits), num_cached_tokens, and the cached run's block ids (int32,
    logical order) in the new-block-ids array. The caller has checked that it fits."""
    write_values_reply(views, seq_id, num_cached_tokens)
    if block_ids.size:
        views.rep_area[fp.HEADER_BYTES:fp.HEADER_BYTES + 4 * block_ids.size].view(np.int32)[:] = block_ids
    views.rep[fp.REP_N_NEW] = block_ids.size


def write_registered_many_reply(views: fp.Views, block_size: int, seq_ids: list[int], cached: list[int],
                                block_ids: np.ndarray) -> None:
    """An OK register-many reply: the block size (value0), each prompt's num_cached_tokens (slots, int64), their
    cached blocks concatenated (new block ids, int32; prompt i's ``cached[i] // block_size``), the seq ids
    (children, uint64). The caller has checked that it fits (``fp.register_many_reply_bytes``)."""
    rep, area = views.rep, views.rep_area
    n = len(cached)
    rep[fp.REP_CODE:fp.REP_MSG_LEN + 1] = 0
    rep[fp.REP_VALUE0], rep[fp.REP_VALUE1] = block_size, 0
    at = fp.HEADER_BYTES
    area[at:at + 8 * n].view(np.int64)[:] = cached
    at += 8 * n
    if block_ids.size:
        area[at:at + 4 * block_ids.size].view(np.int32)[:] = block_ids
    at += fp.align8(4 * block_ids.size)
    area[at:at + 8 * n].view(np.uint64)[:] = seq_ids
    rep[fp.REP_N_SLOTS:fp.REP_N_CHILDREN + 1] = (n, block_ids.size, 0, n)


def write_error_reply(views: fp.Views, code: int, reason: str, message: str) -> None:
    """An error reply: ``code`` (nonzero), ``reason`` (a kvpool-error reason, "" when none or unknown) and the
    message, cut to ``MAX_MESSAGE_BYTES`` (and to the area)."""
    rep, area = views.rep, views.rep_area
    data = message.encode("utf-8", "replace")[:min(fp.MAX_MESSAGE_BYTES, area.size - fp.HEADER_BYTES)]
    area[fp.HEADER_BYTES:fp.HEADER_BYTES + len(data)] = np.frombuffer(data, np.uint8)
    rep[fp.REP_CODE] = code
    rep[fp.REP_REASON] = fp.REASONS.index(reason) if reason in fp.REASONS else 0
    rep[fp.REP_MSG_LEN] = len(data)
    rep[fp.REP_N_SLOTS] = rep[fp.REP_N_NEW] = rep[fp.REP_N_COPIES] = rep[fp.REP_N_CHILDREN] = 0


def publish_reply(views: fp.Views, seq: int) -> None:
    """Publish the written reply as ``seq``: its seq word, then (after the barrier) ``CTL_REP_SEQ``."""
    _WORD.pack_into(views.rep_words, 8 * fp.REP_SEQ, seq)
    memory_barrier()  # the reply's stores before the seq's (x86 keeps them in order anyway; ARM does not)
    views.ctl[fp.CTL_REP_SEQ] = seq  # published: the whole reply is written


# ---------------------------------------------------------------- replies: the client reads
def reply_error(views: fp.Views) -> tuple[int, int, str] | None:
    """The published reply's error -- (code, reason index, message) -- or None when it is OK."""
    memory_barrier()  # the reply's loads after the seq's
    words = views.rep_words
    code = words[fp.REP_CODE]
    if not code:
        return None
    n = min(max(words[fp.REP_MSG_LEN], 0), fp.MAX_MESSAGE_BYTES)
    return code, words[fp.REP_REASON], views.rep_area[fp.HEADER_BYTES:fp.HEADER_BYTES + n].tobytes().decode(
        "utf-8", "replace")


def read_append_reply(views: fp.Views) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An OK append reply's slots, new block ids and copies [c, 2], each int64 and a copy."""
    area, words = views.rep_area, views.rep_words
    n_slots, n_new, n_copies = words[fp.REP_N_SLOTS], words[fp.REP_N_NEW], words[fp.REP_N_COPIES]
    at = fp.HEADER_BYTES
    slots = area[at:at + 8 * n_slots].view(np.int64).copy()
    at += 8 * n_slots
    if n_new <= 0 and n_copies <= 0:  # the usual decode step: no block allocated, nothing copied
        return slots, np.empty(0, np.int64), np.empty((0, 2), np.int64)
    new = area[at:at + 4 * n_new].view(np.int32).astype(np.int64)
    at += (4 * n_new + 7) & ~7
    copies = area[at:at + 8 * n_copies].view(np.int32).astype(np.int64).reshape(-1, 2)
    return slots, new, copies


def read_children(views: fp.Views) -> list[int]:
    """An OK Fork reply's children."""
    n = int(views.rep[fp.REP_N_CHILDREN])
    return views.rep_area[fp.HEADER_BYTES:fp.HEADER_BYTES + 8 * n].view(np.uint64).tolist()


def read_registered_reply(views: fp.Views) -> tuple[int, int, np.ndarray]:
    """An OK register reply: (seq_id, num_cached_tokens, the cached run's block ids: int32, a copy; empty from a
    server that sends none)."""
    seq_id, cached = read_values(views)
    n = min(max(int(views.rep[fp.REP_N_NEW]), 0), (views.rep_area.size - fp.HEADER_BYTES) // 4)
    return seq_id, cached, views.rep_area[fp.HEADER_BYTES:fp.HEADER_BYTES + 4 * n].view(np.int32).copy()


def read_values(views: fp.Views) -> tuple[int, int]:
    """An OK reply's two values, the first as its uint64 (a register's seq_id; a free's count is never negative)."""
    return int(views.rep[fp.REP_VALUE0]) & (WRAP - 1), int(views.rep[fp.REP_VALUE1])


def read_registered_many_reply(views: fp.Views) -> list[tuple[int, int, np.ndarray]]:
    """An OK register-many reply: (seq_id, num_cached_tokens, its cached block ids: int32, a copy) per prompt."""
    rep, area = views.rep, views.rep_area
    block_size, n_slots, n_new, n_children = (int(rep[fp.REP_VALUE0]), int(rep[fp.REP_N_SLOTS]),
                                              int(rep[fp.REP_N_NEW]), int(rep[fp.REP_N_CHILDREN]))
    return read_registered(area, fp.HEADER_BYTES, block_size, n_slots, n_new, n_children)


def read_registered(area: np.ndarray, at: int, block_size: int, n: int, n_blocks: int,
                    n_seqs: int) -> list[tuple[int, int, np.ndarray]]:
    """The registered prompts' part of a reply at ``at``: ``n`` cached-token counts (int64), their ``n_blocks``
    cached block ids (int32, padded to 8 bytes), ``n_seqs`` seq_ids (uint64) -> (seq_id, cached, its blocks: a
    copy) per prompt (a register-many reply's whole area; a step reply's register part)."""
    cached = area[at:at + 8 * n].view(np.int64).tolist()
    at += 8 * n
    blocks = area[at:at + 4 * n_blocks].view(np.int32).copy()
    at += fp.align8(4 * n_blocks)
    seq_ids = area[at:at + 8 * n_seqs].view(np.uint64).tolist()
    ends = np.cumsum([c // max(block_size, 1) for c in cached]).tolist()
    return [(seq_id, c, blocks[end - c // max(block_size, 1):end]) for seq_id, c, end in zip(seq_ids, cached, ends)]
