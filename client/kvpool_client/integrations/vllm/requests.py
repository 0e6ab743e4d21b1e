"""What the scheduler side keeps per vLLM request, and which requests kvpool can cache (their ``cache_extra_key``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .settings import MAX_CACHE_KEY_BYTES


@dataclass
class RequestState:
    """One request's kvpool sequence ``seq_id`` (None: none) of connection ``generation``.

    The sequence holds ``seq_tokens`` tokens of the request (its token ids in order); the first ``kv_tokens`` of
    them (whole blocks) have their KV in the pool blocks ``pool_blocks`` -- copied there, or being copied this step.
    ``seq_tokens`` is ``kv_tokens``, or one more once an append has sealed them (the seal is the request's next
    token). ``unsealed``: blocks with KV that no append has sealed yet; ``poisoned``: a copy into its blocks failed,
    so nothing of it is ever sealed (freed unmatchable)."""

    seq_id: int | None = None
    generation: int = 0
    kv_tokens: int = 0
    seq_tokens: int = 0
    pool_blocks: list[int] = field(default_factory=list)
    local_tokens: int = 0  # vLLM's own hit, as last given to get_num_new_matched_tokens
    request: Any = None  # vLLM's Request, for prompt stores (its token ids); None when they are off
    key: bytes = b""
    unsealed: bool = False
    poisoned: bool = False
    saved_step: int = -1  # the step whose forward pass computed (and whose workers copied) the unsealed blocks

    def num_tokens(self) -> int:
        """The request's tokens so far (its prompt and outputs), 0 without it."""
        return len(self.request.all_token_ids) if self.request is not None else 0

    def token(self, position: int) -> int:
        return int(self.request.all_token_ids[position])


@dataclass
class Store:
    """Full blocks to put into kvpool: the request's ``tokens`` from 0 to a block boundary, whose blocks are
    ``vllm_blocks`` in vLLM; ``seal_token`` follows them (a finished request's: its seal)."""

    req_id: str
    state: RequestState
    tokens: list[int]
    seal_token: int
    vllm_blocks: list[int]
    key: bytes
    running: bool  # a running request's prompt blocks (no finished_sending), else a finished request's


def cache_key(request: Any, namespace: str) -> bytes | None:
    """The ``cache_extra_key`` of a request (its LoRA adapter and cache salt, and the connector's namespace), or
    None for a request kvpool cannot cache: prompt embeddings, multimodal inputs, a key over kvpool's bound."""
    if getattr(request, "prompt_embeds", None) is not None or getattr(request, "mm_features", None):
        return None
    lora = getattr(request, "lora_request", None)
    return cache_key_bytes(namespace, getattr(lora, "lora_name", None), getattr(request, "cache_salt", None))


def cache_key_bytes(namespace: str, lora: str | None, salt: str | None) -> bytes | None:
    if not (namespace or lora or salt):
        return b""
    key = f"vllm:{namespace}\x00lora:{lora or ''}\x00salt:{salt or ''}".encode()
    return key if len(key) <= MAX_CACHE_KEY_BYTES else None
