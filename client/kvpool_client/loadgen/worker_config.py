"""What one load-generator process is told: its share of the load and the workload (docs/loadgen.md)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool_client.credentials import Credentials

EXHAUSTED_WAIT_S = 30.0  # how long a step waits for other processes to free blocks before it gives up


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: int
    target: str
    concurrency: int  # this process's share of the in-flight requests
    completions: int  # requests in the whole run
    seed: int = 0
    lengths: str = "uniform"
    max_len: int | None = None
    mode: str = "plain"
    beam_width: int = 4
    num_samples: int = 4
    prune_every: int = 4
    verify: str = "both"  # "table" (GetBlockTable + attached pool), "readkv" (ReadKV), "both"
    timeout: float = 30.0
    inject_errors: int = 0  # self-test: corrupt one token of the first sequence verified of requests 0..k-1
    exhausted_wait_s: float = EXHAUSTED_WAIT_S  # --exhausted-wait: how long a step waits for blocks to be freed
    # "host": KV written from NumPy arrays (the pool's host path: pinned staging on a GPU pool); "device": from CuPy
    # device arrays (pattern and slots uploaded first), one scatter kernel per write -- needs a GPU pool;
    # "auto": device on a GPU pool, host otherwise
    kv_source: str = "auto"
    token: str | None = None  # the bearer token this process calls with (--token, or its tenant's)
    tenant: str = ""  # --tenants: the tenant that token belongs to
    # --workload shared-prefix: each request = one of num_prompts shared prompts (shared_tokens) + unique_tokens of
    # its own, registered with its token ids (prefix caching); every appended token carries its id.
    # --workload chat: each claimed index is a conversation of num_turns turns (turn_tokens a user message); each
    # turn is a request whose prompt is the conversation so far. no_prefix_cache: the same without token ids.
    workload: str = "standard"
    num_prompts: int = 4
    shared_tokens: int = 8000
    unique_tokens: int = 1000
    num_turns: int = 4
    turn_tokens: int = 64
    no_prefix_cache: bool = False
    fast_path: bool = True  # register/append/fork/free over the session's shared-memory channel when local
    credentials: Credentials | None = None  # TLS material of every connection (credentials.py); the token is above
    kv_path: str = "auto"  # "attach" (the mapped pool), "grpc" (WriteKV/ReadKV), "auto" (kv_path.py)
