"""What the load generator runs: length distributions, per-request specs and the beam rule. Pure and seeded.

Request i of a run depends only on (seed, i), never on which process serves it or when, so two runs with the same
seed run the same requests (the interleaving of processes still differs).

Lengths. A request has a prompt and an output; its sequence grows to ``prompt_len + output_len`` tokens, never more
than ``max_len``:
  uniform   the default: prompt uniform in [4, 32], *target* (prompt + output) uniform in [32, max_len=256];
            output = target - prompt (at least 1).
  sharegpt  lognormal prompt (mean 161, sigma 1.0) and output (mean 338, sigma 0.8), clipped to max_len=2048.
  alpaca    lognormal prompt (mean 19, sigma 0.6) and output (mean 58, sigma 0.8), clipped to max_len=2048.
The lognormal means are those commonly quoted from the PagedAttention paper's Fig. 11; the sigmas are our choice
(the paper gives histograms, not parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MODES = ("plain", "beam", "parallel")


@dataclass(frozen=True)
class LengthDistribution:
    name: str
    max_len: int
    prompt_mean: float = 0.0
    prompt_sigma: float = 0.0
    output_mean: float = 0.0
    output_sigma: float = 0.0

    def sample(self, rng: np.random.Generator, num_outputs: int = 1) -> tuple[int, tuple[int, ...]]:
        """(prompt_len, output_lens): ``num_outputs`` outputs for one prompt, each prompt + output <= max_len."""
        if self.name == "uniform":
            prompt_len = int(rng.integers(4, min(32, self.max_len - 1) + 1))
            targets = rng.integers(32, self.max_len + 1, size=num_outputs)
            outputs = np.maximum(targets - prompt_len, 1)
        else:
            prompt_len = int(np.clip(round(_lognormal(rng, self.prompt_mean, self.prompt_sigma)), 1, self.max_len - 1))
            raw = [_lognormal(rng, self.output_mean, self.output_sigma) for _ in range(num_outputs)]
            outputs = np.clip(np.round(raw), 1, self.max_len - prompt_len)
        return prompt_len, tuple(int(x) for x in outputs)


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> float:
    """A lognormal draw with the given *mean* (not median): mu = ln(mean) - sigma^2 / 2."""
    return float(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma))


def distribution(name: str, max_len: int | None = None) -> LengthDistribution:
    if name == "uniform":
        return LengthDistribution("uniform", max_len or 256)
    if name == "sharegpt":
        return LengthDistribution("sharegpt", max_len or 2048, 161, 1.0, 338, 0.8)
    if name == "alpaca":
        return LengthDistribution("alpaca", max_len or 2048, 19, 0.6, 58, 0.8)
    raise ValueError(f"unknown length distribution {name!r}; choose uniform, sharegpt or alpaca")


@dataclass(frozen=True)
class RequestSpec:
    """One request: a prompt and the output length of each of its sequences (1 for plain and beam, n for parallel)."""

    index: int
    prompt_len: int
    output_lens: tuple[int, ...]

    @property
    def max_total_len(self) -> int:
        return self.prompt_len + max(self.output_lens)


def make_request(seed: int, index: int, dist: LengthDistribution, mode: str, num_samples: int = 1) -> RequestSpec:
    """Request ``index`` of a run: depends only on (seed, index)."""
    rng = np.random.default_rng([seed, index])
    num_outputs = num_samples if mode == "parallel" else 1
    prompt_len, outputs = dist.sample(rng, num_outputs)
    return RequestSpec(index, prompt_len, outputs)


def sequences_per_request(mode: str, beam_width: int, num_samples: int) -> int:
    return {"plain": 1, "beam": beam_width, "parallel": num_samples}[mode]


# ---------------------------------------------------------------- the beam rule
_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def beam_score(seed: int, request_index: int, step: int, beam_name: int) -> int:
    """A deterministic stand-in for a beam's log-probability: a hash of who and when."""
    h = _splitmix64(seed & _MASK)
    for part in (request_index, step, beam_name):
        h = _splitmix64(h ^ (part & _MASK))
    return h


def prune_and_refork(
    beam_names: list[int], seed: int, request_index: int, step: int
) -> tuple[list[int], list[int]]:
    """Every few steps: rank beams by score (ties by name); the worst half is freed, each of the best half forks
    once, so the width stays k and the new beams share the best beams' blocks (copy-on-write on the next append).

    Returns (names to free, names to fork), the latter best first.
    """
    k = len(beam_names)
    num_drop = k // 2
    ranked = sorted(beam_names, key=lambda name: (-beam_score(seed, request_index, step, name), name))
    return ranked[k - num_drop :], ranked[:num_drop]


# ---------------------------------------------------------------- the shared-prefix workload
SHARED_WRITER_BASE = 1 << 60  # pseudo writer ids of the shared prompts' KV: SHARED_WRITER_BASE + prompt id
# and of request i's own prompt tokens: REQUEST_WRITER_BASE + i (its blocks are cached too: a later run with the
# same seed on the same server finds them, and must find the bytes it would have written)
REQUEST_WRITER_BASE = 1 << 58
_TOKEN_ID_MASK = (1 << 31) - 1


@dataclass(frozen=True)
class SharedPrefixSpec:
    """One shared-prefix request: shared prompt ``prompt_id`` (``shared_len`` tokens), then ``unique_len`` tokens of
    its own, then ``output_len`` decoded tokens."""

    index: int
    prompt_id: int
    shared_len: int
    unique_len: int
    output_len: int

    @property
    def prompt_len(self) -> int:
        return self.shared_len + self.unique_len

    @property
    def output_lens(self) -> tuple[int, ...]:
        return (self.output_len,)

    @property
    def max_total_len(self) -> int:
        return self.prompt_len + self.output_len


def make_shared_prefix_request(
    seed: int, index: int, dist: LengthDistribution, num_prompts: int, shared_len: int, unique_len: int
) -> SharedPrefixSpec:
    """Request ``index``: a prompt id and an output length (the distribution's), from (seed, index) only."""
    rng = np.random.default_rng([seed, index, 1])
    prompt_id = int(rng.integers(num_prompts))
    _, (output_len,) = dist.sample(rng, 1)
    return SharedPrefixSpec(index, prompt_id, shared_len, unique_len, output_len)


# Token id streams: request i's own tokens are stream i (< 2**40); shared prompt p's are SHARED_STREAM_BASE + p;
# chat conversation c's are chat.CHAT_STREAM_BASE + c; beam ``name`` > 0 of request i decodes stream
# i + name * BEAM_STREAM_STEP (beam 0 is the request's own stream).
SHARED_STREAM_BASE = 1 << 40
BEAM_STREAM_STEP = 1 << 42


def shared_token_ids(seed: int, prompt_id: int, start: int, stop: int) -> np.ndarray:
    """Token ids of shared prompt ``prompt_id`` at positions [start, stop): a function of (seed, prompt, position)."""
    return stream_token_ids(seed, SHARED_STREAM_BASE + prompt_id, start, stop)


def request_token_ids(seed: int, index: int, start: int, stop: int) -> np.ndarray:
    """Token ids of request ``index``'s own tokens (its unique prompt part and its output) at [start, stop)."""
    return stream_token_ids(seed, index, start, stop)


def beam_token_stream(request_index: int, beam_name: int) -> int:
    """The stream a beam decodes from: beams of one request append different tokens (their own hashes)."""
    return request_index + beam_name * BEAM_STREAM_STEP


def stream_token_ids(seed: int, stream: int, start: int, stop: int) -> np.ndarray:
    """Token ids at positions [start, stop) of token stream ``stream``: a function of (seed, stream, position)."""
    h = _splitmix64(_splitmix64(seed & _MASK) ^ (stream & _MASK))
    pos = np.arange(start, stop, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = pos * np.uint64(0x9E3779B97F4A7C15) + np.uint64(h)
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
    return (x & np.uint64(_TOKEN_ID_MASK)).astype(np.uint32)
