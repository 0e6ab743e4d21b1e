"""The fast path's records on the client's side: a writer (the request, not yet published) and a reader (the
reply's answer) for each of register, register many, append, fork and free -- the codec's (kvpool.fastpath_codec, the one
definition of the layout both sides use) bound to the client's arguments and types."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool import fastpath as fp
from kvpool.fastpath_codec import (read_append_reply, read_children, read_registered_many_reply, read_registered_reply,
                                   read_values, register_many_arrays, write_request)
from kvpool_client.types import AppendResult, RegisteredSequence

__all__ = ["write_request", "append_writer", "append_reader", "register_writer", "read_registered",
           "read_registered_blocks", "register_many_writer", "read_registered_many", "fork_writer",
           "read_children", "free_writer", "read_freed"]


def append_writer(generation: int, id_array: np.ndarray, counts_field: np.ndarray, tokens: np.ndarray | None,
                  request_id: int) -> Any:
    return lambda views: write_request(views, fp.OP_APPEND, request_id, generation, ids=id_array, counts=counts_field,
                                       tokens=tokens)


def append_reader(ids: tuple[int, ...], counts: np.ndarray) -> Any:
    def read(views: fp.Views) -> AppendResult:
        slots, new, copies = read_append_reply(views)
        return AppendResult(seq_ids=ids, num_tokens=counts, slot_mapping=slots, new_block_ids=new, copies=copies)

    return read


def register_writer(generation: int, seq_id: int | None, prompt: np.ndarray | None, public_prefix_len: int,
                    cache_extra_key: bytes, request_id: int) -> Any:
    return lambda views: write_request(views, fp.OP_REGISTER, request_id, generation, tokens=prompt,
                                       extra=cache_extra_key, arg0=seq_id or 0, arg1=public_prefix_len)


def read_registered(views: fp.Views) -> tuple[int, int]:
    """(seq_id, num_cached_tokens)."""
    return read_values(views)


def read_registered_blocks(views: fp.Views) -> list[RegisteredSequence]:
    """A register's answer as ``register_prompts``'s: [RegisteredSequence] (its cached block ids from the reply;
    none from a server that sends none)."""
    seq_id, cached, blocks = read_registered_reply(views)
    return [RegisteredSequence(seq_id, cached, blocks)]


def register_many_writer(generation: int, prompts: list[np.ndarray], keys: list[bytes], request_id: int) -> Any:
    """A register-many record of ``prompts`` (uint32 each), ``keys`` one each, no public prefix."""
    ids, counts, tokens, extra = register_many_arrays(prompts, keys, [0] * len(prompts))
    return lambda views: write_request(views, fp.OP_REGISTER_MANY, request_id, generation, ids=ids, counts=counts,
                                       tokens=tokens, extra=extra)


def read_registered_many(views: fp.Views) -> list[RegisteredSequence]:
    """A register-many's answer as ``register_prompts``'s: a RegisteredSequence a prompt, in order."""
    return [RegisteredSequence(seq_id, cached, blocks) for seq_id, cached, blocks in read_registered_many_reply(views)]


def fork_writer(generation: int, parent: int, num_children: int, children: list[int], request_id: int) -> Any:
    return lambda views: write_request(views, fp.OP_FORK, request_id, generation,
                                       ids=np.asarray(children, np.uint64), arg0=parent, arg1=num_children)


def free_writer(generation: int, ids: list[int], request_id: int) -> Any:
    return lambda views: write_request(views, fp.OP_FREE, request_id, generation, ids=np.asarray(ids, np.uint64))


def read_freed(views: fp.Views) -> int:
    return read_values(views)[0]
