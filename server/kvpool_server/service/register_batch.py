"""RegisterSequences: one RegisterSequence per prompt, in one call and all or none (a scheduler's step of lookups).

    registered = service.register_many(call, [PromptToRegister(tokens, 0, key), ...], session_id, request_id)
    registered[i].seq_id, registered[i].num_cached_tokens, registered[i].cached_block_ids

All or none: every prompt is checked before anything changes -- its own arguments as RegisterSequence checks them
(``check_batch`` here and the core's ``check_register_args`` through ``hash_input``), the tenant's
``share_prefixes`` for a public prefix, then under the lock the tenant's ``max_sequences`` and the server's
``--max-num-seqs`` for all of them at once (the core's ``register_many``, which refuses a burst whole where one of
its single registers would be refused) -- and a refusal of any refuses the call with that prompt's status,
nothing registered. Every prompt is checked before any is hashed (``checked_input``, then ``hashes_of``): a bad
prompt after good ones costs no hashing. Past those checks a register cannot fail (prefix reuse takes fewer
blocks rather than exceed a quota), so the batch is applied in one lock hold, by one ``register_many``. Both transports
call it: gRPC's RegisterSequences and the fast path's register-many record (which may bring the prompts' hashes,
made on the hasher).

Bounds: at most ``--max-batch`` prompts and ``--max-tokens-per-call`` prompt tokens in all; the reply holds one id
and one count per prompt and at most ``(len(prompt) - 1) // block_size`` block ids each (checked against the
reply limit before anything is applied).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvpool_server.core import InvalidArgumentError
from kvpool_server.core.manager import KVCacheManager
from kvpool_server.core.prefix_reuse import reusable_hashes
from kvpool_server.core.errors import KVPoolError
from kvpool_server.service.auth import Identity, check_may_share_prefixes

if TYPE_CHECKING:
    from kvpool_server.service.prompt_hasher import HashJob, PromptHasher

RPC = "RegisterSequences"
ITEM_BYTES = 24  # a reply's sequence: an id, a count and their keys, beside its block ids (5 bytes each at most)


class PromptToRegister(NamedTuple):
    prompt_token_ids: Sequence[int]
    public_prefix_len: int
    cache_extra_key: bytes


class RegisteredPrompt(NamedTuple):
    seq_id: int
    num_cached_tokens: int
    cached_block_ids: np.ndarray  # int32, num_cached_tokens // block_size of them


def check_batch(prompts: Sequence[PromptToRegister], max_batch: int, max_tokens_per_call: int) -> int:
    """The batch's own bounds (INVALID_ARGUMENT); returns its prompt tokens in all."""
    check_count(len(prompts), max_batch)
    total = 0
    for i, prompt in enumerate(prompts):
        if not len(prompt.prompt_token_ids):
            raise InvalidArgumentError(f"{RPC} prompts[{i}] has no prompt_token_ids (register an empty sequence "
                                       "with RegisterSequence)")
        total += len(prompt.prompt_token_ids)
    if total > max_tokens_per_call:
        raise InvalidArgumentError(f"{RPC} of {total} prompt tokens: at most --max-tokens-per-call="
                                   f"{max_tokens_per_call} tokens a call (split the prompts over several calls)")
    return total


def check_count(num_prompts: int, max_batch: int) -> None:
    """The batch's number of prompts (INVALID_ARGUMENT): 1 to ``max_batch``."""
    if not num_prompts:
        raise InvalidArgumentError(f"{RPC} needs at least one prompt")
    if num_prompts > max_batch:
        raise InvalidArgumentError(f"{RPC} takes at most max_batch={max_batch} prompts, got {num_prompts}")


def checked_input(caller: Identity, manager: KVCacheManager, index: int,
                  prompt: PromptToRegister) -> tuple[np.ndarray, bytes, int]:
    """Prompt ``index`` checked as RegisterSequence checks it (its refusal names it), and what its chain hashes
    hash (``PrefixReuse.hash_input``: no hashing yet)."""
    try:
        check_may_share_prefixes(caller, prompt.public_prefix_len)
        return manager.prefix.hash_input(caller.tenant_id, prompt.prompt_token_ids, prompt.public_prefix_len,
                                         prompt.cache_extra_key)
    except KVPoolError as error:
        error.args = (f"{RPC} prompts[{index}]: {error}",)
        raise


def hashes_of(manager: KVCacheManager, checked: tuple[np.ndarray, bytes, int], cache_extra_key: bytes) -> list[bytes]:
    """A checked prompt's chain hashes (``PrefixReuse.prompt_hashes``'s)."""
    prompt, salt, num_public = checked
    return reusable_hashes(prompt, manager.block_size, salt, num_public, cache_extra_key)


def reply_bytes(prompts: Sequence[PromptToRegister], block_size: int) -> int:
    """The most bytes the reply can take."""
    return 64 + sum(ITEM_BYTES + 5 * max(0, (len(p.prompt_token_ids) - 1) // block_size) for p in prompts)


def registered(manager: KVCacheManager, seq_id: int, tenant: int | None) -> RegisteredPrompt:
    """What a new sequence starts with: its cached tokens and their blocks."""
    num_tokens = manager.num_tokens(seq_id, tenant)
    blocks = manager.block_table(seq_id, tenant)[: num_tokens // manager.block_size].astype(np.int32)
    return RegisteredPrompt(seq_id, num_tokens, blocks)


def submit_hashing(hasher: PromptHasher, key: int, tenant: int | None, prompts: Sequence[PromptToRegister],
                   max_batch: int, max_tokens_per_call: int,
                   on_done: Callable[[HashJob], None]) -> list[HashJob] | None:
    """The batch's hashes queued on the hasher, one job a prompt (``PromptHasher.submit_many``; ``on_done`` once
    the last is done), for a transport that then serves the batch with them. None: not queued -- a batch the
    service refuses by its count or its size (``check_batch``), or one of whose prompts the hasher's checks refuse
    (``register_many`` then refuses it, checking every prompt before it hashes any). The hasher full: its
    QuotaExceededError, nothing queued."""
    try:
        check_batch(prompts, max_batch, max_tokens_per_call)
    except InvalidArgumentError:
        return None
    return hasher.submit_many(key, tenant, prompts, on_done)
