"""The fast path's four records on the client's side: a writer (the request, not yet published) and a reader (the
reply's answer) for each of register, append, fork and free. The layout: kvpool.fastpath (docs/fast-path.md)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool import fastpath as fp
from kvpool_client.types import AppendResult


def write_request(views: fp.Views, op: int, request_id: int, generation: int, *, ids: Any = None, counts: Any = None,
             tokens: Any = None, extra: bytes = b"", arg0: int = 0, arg1: int = 0) -> None:
    """Write a request record's arrays and header (not yet published)."""
    area, req = views.req_area, views.req
    n_ids = 0 if ids is None else ids.size
    n_counts = 0 if counts is None else counts.size
    n_tokens = 0 if tokens is None else tokens.size
    at = fp.HEADER_BYTES
    if n_ids:
        area[at:at + 8 * n_ids].view(np.uint64)[:] = ids
    at += 8 * n_ids
    if n_counts:
        area[at:at + 4 * n_counts].view(np.uint32)[:] = counts
    at += fp.align8(4 * n_counts)
    if n_tokens:
        area[at:at + 4 * n_tokens].view(np.uint32)[:] = tokens
    at += fp.align8(4 * n_tokens)
    if extra:
        area[at:at + len(extra)] = np.frombuffer(extra, np.uint8)
    wrap = 1 << 64  # uint64 fields as the int64 words with the same bits
    req[:fp.REQ_SEQ] = (op, request_id - wrap if request_id >= 1 << 63 else request_id, generation, n_ids, n_counts,
                        n_tokens, arg0 - wrap if arg0 >= 1 << 63 else arg0, arg1, len(extra))



# ---------------------------------------------------------------- the four records: writers and readers
def append_writer(generation: int, id_array: np.ndarray, counts_field: np.ndarray, tokens: np.ndarray | None,
                  request_id: int) -> Any:
    return lambda views: write_request(views, fp.OP_APPEND, request_id, generation, ids=id_array, counts=counts_field,
                                  tokens=tokens)


def append_reader(ids: tuple[int, ...], counts: np.ndarray) -> Any:
    def read(views: fp.Views) -> AppendResult:
        rep, area = views.rep, views.rep_area
        n_slots, n_new, n_copies = rep[fp.REP_N_SLOTS:fp.REP_N_COPIES + 1].tolist()
        at = fp.HEADER_BYTES
        slots = area[at:at + 8 * n_slots].view(np.int64).copy()
        at += 8 * n_slots
        new = area[at:at + 4 * n_new].view(np.int32).astype(np.int64)
        at += fp.align8(4 * n_new)
        copies = area[at:at + 8 * n_copies].view(np.int32).astype(np.int64).reshape(-1, 2)
        return AppendResult(seq_ids=ids, num_tokens=counts, slot_mapping=slots, new_block_ids=new, copies=copies)

    return read


def register_writer(generation: int, seq_id: int | None, prompt: np.ndarray | None, public_prefix_len: int,
                    cache_extra_key: bytes, request_id: int) -> Any:
    return lambda views: write_request(views, fp.OP_REGISTER, request_id, generation, tokens=prompt,
                                  extra=cache_extra_key, arg0=seq_id or 0, arg1=public_prefix_len)


def read_registered(views: fp.Views) -> tuple[int, int]:
    return int(views.rep[fp.REP_VALUE0]) & ((1 << 64) - 1), int(views.rep[fp.REP_VALUE1])


def fork_writer(generation: int, parent: int, num_children: int, children: list[int], request_id: int) -> Any:
    return lambda views: write_request(views, fp.OP_FORK, request_id, generation, ids=np.asarray(children, np.uint64),
                                  arg0=parent, arg1=num_children)


def read_children(views: fp.Views) -> list[int]:
    n = int(views.rep[fp.REP_N_CHILDREN])
    return views.rep_area[fp.HEADER_BYTES:fp.HEADER_BYTES + 8 * n].view(np.uint64).tolist()


def free_writer(generation: int, ids: list[int], request_id: int) -> Any:
    return lambda views: write_request(views, fp.OP_FREE, request_id, generation, ids=np.asarray(ids, np.uint64))


def read_freed(views: fp.Views) -> int:
    return int(views.rep[fp.REP_VALUE0])
