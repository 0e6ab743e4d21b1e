"""vLLM v1's BlockPool loaded from extracted source files, and a driver that calls it as vLLM's KV cache manager does.

vLLM is not installed (and cannot be, on the benchmark hosts); its code is not part of kvpool. ``load(src)`` loads
three of its files from ``src`` (extracted by ``scripts/extract_vllm_core.sh``), each under its own module name:

    vllm/utils/hashing.py          sha256 (pickle + SHA-256: vLLM's default prefix_caching_hash_algo)
    vllm/v1/core/kv_cache_utils.py KVCacheBlock, FreeKVCacheBlockQueue, hash_block_tokens, get_request_block_hasher
    vllm/v1/core/block_pool.py     BlockPool (get_new_blocks, cache_full_blocks, touch, free_blocks)

Everything else those files import is a stub module put in ``sys.modules`` first (``_install_stubs``): a stub
answers any name with an empty placeholder class (enough for imports and annotations), and gives real values only
where the code under test reads them: ``vllm.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (False),
``vllm.logger.init_logger`` (logging.getLogger), ``vllm.utils.math_utils.cdiv``, ``vllm.distributed.kv_events``'s
``MEDIUM_GPU``. KV events are off (``enable_kv_cache_events=False``), there is no metrics collector, no multimodal
input and no LoRA, so no stubbed code runs on the measured path. ``cbor2`` (only for the sha256_cbor algorithm) is
stubbed when it is not installed.

``VllmDriver`` is the part of vLLM's ``KVCacheManager`` -> ``KVCacheCoordinator`` -> ``FullAttentionManager``
(single_type_kv_cache_manager.py) that a one-group, full-attention model runs around the BlockPool, written out
here because those classes need vLLM's configs: ``req_to_blocks`` and ``num_cached_block`` per request,
``get_computed_blocks`` (find_longest_cache_hit over the request's block hashes, at most ``num_tokens - 1`` tokens),
``allocate_slots`` (the free-block check, ``touch`` of the hit blocks, ``get_new_blocks`` for the missing ones,
``cache_blocks`` -> ``cache_full_blocks`` up to the hashed full blocks) and ``free`` (``free_blocks`` in reverse
order); with ``enable_caching=False`` the hashing, the lookup and the caching are skipped as vLLM skips them
(``VllmDriver`` says where). ``DriverRequest`` keeps the fields of ``vllm.v1.request.Request`` that the pool and the block hasher read,
the way Request keeps them: the prompt's full blocks are hashed when it is created, and each appended output token
runs the hasher (``append_output_token_ids`` -> ``update_block_hashes``), as in vLLM (no hasher: caching off).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

VLLM_FILES = ("vllm/utils/hashing.py", "vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/block_pool.py")

_STUBS: dict[str, dict[str, Any]] = {  # module -> the names whose values matter (others: placeholders)
    "vllm": {},
    "vllm.envs": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": False},
    "vllm.config": {},
    "vllm.logger": {"init_logger": logging.getLogger},
    "vllm.multimodal": {},
    "vllm.multimodal.utils": {},
    "vllm.utils": {},
    "vllm.utils.math_utils": {"cdiv": lambda a, b: -(a // -b)},
    "vllm.utils.mem_utils": {},  # vLLM 0.32+ (kv_cache_utils imports these; nothing on the measured path)
    "vllm.utils.torch_utils": {},
    "vllm.v1.hisparse": {},
    "vllm.v1.hisparse.layout": {},
    "vllm.distributed": {},
    "vllm.distributed.kv_events": {"MEDIUM_GPU": "GPU"},
    "vllm.v1": {},
    "vllm.v1.core": {},
    "vllm.v1.core.kv_cache_metrics": {},
    "vllm.v1.kv_cache_interface": {},
    "vllm.v1.kv_cache_spec_registry": {},
    "vllm.v1.request": {},
    "vllm.v1.utils": {},
}


def missing_files(src: Path) -> list[str]:
    return [name for name in VLLM_FILES if not (src / name).is_file()]


def _stub_module(name: str, values: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package: stubs and loaded files may sit below it
    module.__dict__.update(values)

    def __getattr__(attr: str) -> type:  # PEP 562: any other name is an empty placeholder class
        if attr.startswith("__"):
            raise AttributeError(attr)
        placeholder = type(attr, (), {"__module__": name})
        setattr(module, attr, placeholder)
        return placeholder

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def _install_stubs() -> None:
    for name, values in _STUBS.items():
        sys.modules[name] = _stub_module(name, values)
    sys.modules["vllm"].envs = sys.modules["vllm.envs"]  # type: ignore[attr-defined]
    try:
        import cbor2  # noqa: F401
    except ImportError:
        sys.modules["cbor2"] = _stub_module("cbor2", {})


def _load_file(src: Path, relative: str) -> types.ModuleType:
    name = relative[: -len(".py")].replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, src / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Vllm:
    """The loaded modules: ``hashing``, ``utils`` (kv_cache_utils), ``block_pool``."""

    def __init__(self, src: Path) -> None:
        _install_stubs()
        self.hashing, self.utils, self.block_pool = (_load_file(src, name) for name in VLLM_FILES)
        self.utils.init_none_hash(self.hashing.sha256)
        origin = src / "VLLM_SOURCE.txt"  # written by scripts/extract_vllm_core.sh
        self.origin = origin.read_text().strip() if origin.is_file() else str(src)


class DriverRequest:
    """The fields of vllm.v1.request.Request that BlockPool and get_request_block_hasher read, kept as Request keeps
    them (token ids in a list, block hashes extended by the hasher on creation and on every appended token)."""

    def __init__(self, request_id: str, prompt: list[int], hasher: Any | None) -> None:
        self.request_id = request_id
        self._all_token_ids = list(prompt)
        self.all_token_ids = self._all_token_ids
        self.block_hashes: list[bytes] = []
        self.mm_features: list[Any] = []
        self.lora_request = None
        self.cache_salt = None
        self.prompt_embeds = None
        self.session_id = None
        self.shared_prefix_boundary = 0
        self._prompt_embeds_per_block_hashes: dict[Any, bytes] = {}
        self._block_hasher = hasher
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    def append_output_token_ids(self, token_id: int) -> None:
        self._all_token_ids.append(token_id)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:  # None: prefix caching off (vLLM's engine core makes no hasher)
            self.block_hashes.extend(self._block_hasher(self))


class VllmDriver:
    """vLLM's KV cache manager around one BlockPool (one KV cache group, full attention).

    ``enable_caching=False`` is vLLM without prefix caching (``--no-enable-prefix-caching``), as its code runs it:
    the engine core makes no block hasher (``request_block_hasher`` is None: no request hashes its blocks),
    ``get_computed_blocks`` skips the lookup (``prefix_cache_lookup_enabled``), ``KVCacheManager.cache_blocks`` does
    nothing, and the BlockPool (``enable_caching=False``) neither evicts a cached block in ``get_new_blocks`` nor keeps
    one in ``free_blocks`` (every freed block goes to the front of the free queue, LIFO)."""

    def __init__(self, vllm: Vllm, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        pool_class = vllm.block_pool.BlockPool
        kwargs: dict[str, Any] = {"enable_kv_cache_events": False}
        if "hash_block_size" in inspect.signature(pool_class).parameters:
            kwargs["hash_block_size"] = block_size
        self.pool = pool_class(num_blocks + 1, enable_caching, **kwargs)  # + vLLM's null block
        self.enable_caching = enable_caching
        self.block_size = block_size
        self.hasher = vllm.utils.get_request_block_hasher(block_size, vllm.hashing.sha256) if enable_caching else None
        self.req_to_blocks: defaultdict[str, list[Any]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}

    def add_request(self, request_id: str, prompt: list[int]) -> DriverRequest:
        """A new request scheduled whole: Request (hashes the prompt's full blocks when caching), get_computed_blocks
        (no lookup without caching), allocate_slots for the prompt."""
        request = DriverRequest(request_id, prompt, self.hasher)
        hit = self._longest_cache_hit(request) if self.enable_caching else None
        if not self.allocate_slots(request, hit):
            raise RuntimeError("vLLM's pool is full: raise --num-blocks")
        return request

    def _longest_cache_hit(self, request: DriverRequest) -> list[Any]:
        """FullAttentionManager.find_longest_cache_hit: the run of cached full blocks from the start, at most
        num_tokens - 1 tokens (the last token is always computed)."""
        get_cached_block, hit = self.pool.get_cached_block, []
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            cached = get_cached_block(block_hash, [0])
            if not cached:
                break
            hit.append(cached[0])
        return hit

    def allocate_slots(self, request: DriverRequest, hit: list[Any] | None = None) -> bool:
        """KVCacheManager.allocate_slots for a request whose every token needs a slot: False if the pool is
        short."""
        request_id, num_tokens = request.request_id, request.num_tokens
        blocks = self.req_to_blocks[request_id]
        num_new = -(num_tokens // -self.block_size) - len(blocks) - (len(hit) if hit else 0)
        if num_new > self.pool.get_num_free_blocks():
            return False
        if hit is not None:  # a new request: add_local_computed_blocks
            self.pool.touch(hit)
            blocks.extend(hit)
            self.num_cached_block[request_id] = len(blocks)
        if num_new > 0:
            blocks.extend(self.pool.get_new_blocks(num_new))
        if not self.enable_caching:  # KVCacheManager.cache_blocks: only if enabled
            return True
        # cache_blocks: the full blocks that have a hash
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if num_cached < num_full:
            self.pool.cache_full_blocks(request, blocks, num_cached, num_full, self.block_size, 0)
            self.num_cached_block[request_id] = num_full
        return True

    def decode(self, request: DriverRequest, token_id: int) -> None:
        """One decode step of a running request: the sampled token appended (update_from_output), then its slot
        (allocate_slots of one token)."""
        request.append_output_token_ids(token_id)
        if not self.allocate_slots(request):
            raise RuntimeError("vLLM's pool is full: raise --num-blocks")

    def free(self, request_id: str) -> None:
        """SingleTypeKVCacheManager.free: the blocks back to the pool, tail first."""
        self.num_cached_block.pop(request_id, None)
        self.pool.free_blocks(reversed(self.req_to_blocks.pop(request_id, [])))

    def num_used_blocks(self) -> int:
        return self.pool.num_gpu_blocks - 1 - self.pool.get_num_free_blocks()

    def num_cached_blocks(self) -> int:
        """Blocks of the pool that carry a block hash (in its prefix cache, used or evictable)."""
        return sum(block.block_hash is not None for block in self.pool.blocks)
