"""The connector's settings (vLLM's ``kv_connector_extra_config``) and the model's KV layout, checked against the
pool's.

    kv_connector_extra_config = {
        "target": "unix:/run/kvpool.sock",   # required: the kvpool server (a unix: target or host:port)
        "token_file": "/etc/kvpool/token",   # optional: a secured server's bearer token; the token is the tenant
        "timeout_s": 1.0,                    # optional: the deadline of each call to kvpool (a miss when passed)
        "retry_s": 2.0,                      # optional: how often an unreachable kvpool is tried again
        "cache_key": "",                     # optional: hashed into every block (a model's name: see docs/vllm.md)
    }

The layout is what vLLM allocates (its one KV cache group's spec and its layers) in kvpool's terms; a pool whose
layout differs cannot hold the model's KV, and the connector refuses to start, naming both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.layout import KVLayout

DTYPE_NAMES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
MAX_CACHE_KEY_BYTES = 256  # RegisterSequenceRequest.cache_extra_key's bound


class ConnectorConfigError(ValueError):
    """kvpool is reachable but cannot serve this vLLM as configured: vLLM does not start (the message says why)."""


class LayoutMismatchError(ConnectorConfigError):
    """The pool's layout cannot hold the model's KV (the message names both)."""


@dataclass(frozen=True)
class ConnectorSettings:
    target: str
    token_file: str | None = None
    timeout_s: float = 1.0
    retry_s: float = 2.0
    cache_key: str = ""

    @staticmethod
    def from_extra_config(extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        target = extra.pop("target", None)
        if not isinstance(target, str) or not target:
            raise ValueError('KVPoolConnector needs kv_connector_extra_config {"target": "unix:/path.sock"} '
                             "(the kvpool server's address)")
        known = {"token_file", "timeout_s", "retry_s", "cache_key"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"KVPoolConnector: unknown kv_connector_extra_config keys {unknown} "
                             f"(known: target, {', '.join(sorted(known))})")
        settings = ConnectorSettings(target, extra.get("token_file"), float(extra.get("timeout_s", 1.0)),
                                     float(extra.get("retry_s", 2.0)), str(extra.get("cache_key", "")))
        if settings.timeout_s <= 0 or settings.retry_s <= 0:
            raise ValueError("KVPoolConnector: timeout_s and retry_s must be > 0")
        if len(settings.cache_key.encode()) > MAX_CACHE_KEY_BYTES // 2:
            raise ValueError(f"KVPoolConnector: cache_key is at most {MAX_CACHE_KEY_BYTES // 2} bytes")
        return settings

    def token(self) -> str | None:
        if not self.token_file:
            return None
        from kvpool_client.credentials import read_token_file

        return read_token_file(self.token_file)


@dataclass(frozen=True)
class ModelLayout:
    """The KV vLLM keeps for the model, per block: layers x (K, V) x block_size x KV heads x head size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def describe(self) -> str:
        return (f"{self.num_layers} layers, {self.num_kv_heads} KV heads, head size {self.head_dim}, "
                f"block size {self.block_size}, {self.dtype}")

    def check_pool(self, pool: KVLayout, target: str) -> None:
        """Raise LayoutMismatchError unless the pool at ``target`` holds exactly this KV."""
        theirs = ModelLayout(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size, pool.dtype)
        if theirs != self:
            raise LayoutMismatchError(
                f"KVPoolConnector: the kvpool pool at {target} cannot hold this model's KV: the model (vLLM) has "
                f"{self.describe()}; the pool has {theirs.describe()}. Start kvpool-server with --num-layers "
                f"{self.num_layers} --num-kv-heads {self.num_kv_heads} --head-dim {self.head_dim} --block-size "
                f"{self.block_size} --dtype {self.dtype} (or give vLLM block_size={pool.block_size})")


def model_layout(vllm_config: Any, kv_cache_config: Any) -> ModelLayout:
    """The layout of vLLM's KV cache: one group of full attention (no sliding window, no MLA, no Mamba), one rank."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError("KVPoolConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 only "
                         f"(got {parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size})")
    if getattr(vllm_config.model_config, "use_mla", False):
        raise ValueError("KVPoolConnector does not support MLA attention (its latent cache is not K/V per head)")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec \
            or isinstance(groups[0].kv_cache_spec, MLAAttentionSpec):
        raise ValueError(f"KVPoolConnector supports models whose KV cache is one group of full attention; this "
                         f"model has {kinds} (sliding-window, hybrid, Mamba and MLA models are not supported)")
    spec = groups[0].kv_cache_spec
    if getattr(spec, "head_size_v", spec.head_size) not in (None, spec.head_size):
        raise ValueError("KVPoolConnector needs K and V of the same head size")
    dtype = DTYPE_NAMES.get(str(spec.dtype))
    if dtype is None:
        raise ValueError(f"KVPoolConnector: kvpool has no {spec.dtype} pool (float32, float16, bfloat16)")
    return ModelLayout(len(groups[0].layer_names), spec.num_kv_heads, spec.head_size, spec.block_size, dtype)
