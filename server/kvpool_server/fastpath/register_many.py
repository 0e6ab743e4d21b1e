"""The register-many record (``OP_REGISTER_MANY``): a RegisterSequences of N prompts in one fast-path record.

    record    ids = key lengths, counts = token counts + public_prefix_lens, tokens, extra (kvpool.fastpath)
    prompts   prompts_of(): the arrays split into ``PromptToRegister``s (``codec.split_register_many``: lengths that
              do not sum are INVALID_ARGUMENT), after N is checked against --max-batch (nothing per prompt is
              built for a record over it); the reply's bound checked against the reply area
    applied   ``service.register_many`` -- the very call gRPC's RegisterSequences makes: the same checks in the same
              order, the same statuses and messages, all or none, the reply limit checked before anything is applied
    reply     write_reply(): the block size, the cached counts, the cached block ids, the seq ids (the codec's)

The hashing: a batch of more than ``CHUNK_BLOCKS`` full blocks in all (``PromptHasher.is_long_batch``) is hashed on the hasher
(``submit``: one job a prompt, in order, of the session's fair share, CHUNK_BLOCKS blocks a chunk, short prompts
sharing one),
while the fast-path thread serves the other channels (``fair_channels``), then served with those hashes. So the
fast-path thread hashes at most CHUNK_BLOCKS blocks of any record inline -- the bound of a single register
record -- and spends on a batch only its locked part (each block's cache lookup and a row per prompt: the same
per-token work as one register of as many tokens), whatever its length (at most --max-tokens-per-call tokens).
A batch the service refuses by its count or its size, or whose prompts do not all pass the hasher's checks, is not
hashed: ``register_many`` refuses it, checking every prompt before it hashes any.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np

from kvpool import fastpath as fp
from kvpool import fastpath_codec as codec
from kvpool_server.core import InvalidArgumentError
from kvpool_server.service import register_batch
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.prompt_hasher import HashJob
from kvpool_server.service.register_batch import PromptToRegister, RegisteredPrompt

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, bytes]


def split(service: KVPoolService, arrays: Arrays) -> list[PromptToRegister]:
    """The record's prompts, or INVALID_ARGUMENT: more than --max-batch (checked first, as RegisterSequences
    checks it), or lengths that do not match the arrays."""
    ids, counts, tokens, extra = arrays
    register_batch.check_count(ids.size, service.max_batch)
    try:
        return [PromptToRegister(cast(Any, t), p, k) for t, p, k in codec.split_register_many(ids, counts, tokens, extra)]
    except codec.RecordInconsistent as exc:
        raise InvalidArgumentError(str(exc)) from None


def prompts_of(service: KVPoolService, area_bytes: int, arrays: Arrays) -> list[PromptToRegister]:
    """``split``, and the reply's bound checked against the reply area (INVALID_ARGUMENT, "send it over gRPC":
    never for a record that fitted a request area as big, see ``fp.register_many_reply_bytes``)."""
    prompts = split(service, arrays)
    bs = service.guard.manager.block_size
    blocks = sum(max(0, (len(p.prompt_token_ids) - 1) // bs) for p in prompts)
    if fp.register_many_reply_bytes(len(prompts), blocks) > area_bytes:
        raise InvalidArgumentError(f"fast path: the reply of a RegisterSequences of {len(prompts)} prompts may not "
                                   f"fit the {area_bytes}-byte reply area: send it over gRPC")
    return prompts


def submit(service: KVPoolService, key: int, tenant: int | None, arrays: Arrays,
           on_done: Callable[[HashJob], None]) -> list[HashJob] | None:
    """The record's prompts queued on the hasher (``register_batch.submit_hashing``: None where the service would
    refuse the batch; the hasher full: its QuotaExceededError, nothing queued -- the caller then serves the record
    inline, as a register)."""
    try:
        prompts = split(service, arrays)
    except InvalidArgumentError:
        return None
    return register_batch.submit_hashing(service.hasher, key, tenant, prompts, service.max_batch,
                                         service.limits.max_tokens_per_call, on_done)


def write_reply(views: fp.Views, block_size: int, answer: tuple[RegisteredPrompt, ...]) -> None:
    """The OK reply of ``register_many``'s answer. Its size is checked before anything is written (a bug of ours
    if it does not fit: ``prompts_of`` checked the bound)."""
    blocks = [a.cached_block_ids for a in answer]
    n_blocks = sum(b.size for b in blocks)
    if fp.register_many_reply_bytes(len(answer), n_blocks) > views.area_bytes:
        raise AssertionError(f"kvpool bug: a RegisterSequences reply of {n_blocks} block ids passed its bound")
    codec.write_registered_many_reply(views, block_size, [a.seq_id for a in answer],
                                      [a.num_cached_tokens for a in answer],
                                      np.concatenate(blocks) if blocks else np.zeros(0, np.int32))
