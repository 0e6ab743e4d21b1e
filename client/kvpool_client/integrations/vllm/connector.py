"""KVPoolConnector: vLLM v1's KV connector (``KVConnectorBase_V1``) on kvpool -- every vLLM engine of a host, and
kvpool's own frontends, on one shared prefix cache.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool_client.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"target": "unix:/run/kvpool.sock"}}'

vLLM builds the class twice: in the scheduler's process (role SCHEDULER: scheduler.py, which talks to kvpool) and
in each worker (role WORKER: worker.py, which maps the pool and copies blocks). This class only routes vLLM's calls
to the one of the two its role has; each method says which side it belongs to.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from .link import KVPoolLink
from .metadata import KVPoolConnectorMetadata
from .scheduler import KVPoolScheduler
from .settings import ConnectorSettings, model_layout
from .worker import KVPoolWorker


class KVPoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        layout = model_layout(vllm_config, kv_cache_config)
        self.scheduler: KVPoolScheduler | None = None
        self.worker: KVPoolWorker | None = None
        # kvpool is a cache: a block that failed to load is recomputed, never a failed request. vLLM reads the policy
        # after it built the scheduler's connector, so this holds for every engine that loads this connector.
        self._kv_transfer_config.kv_load_failure_policy = "recompute"
        if role == KVConnectorRole.SCHEDULER:
            name = f"vllm:{vllm_config.model_config.served_model_name or vllm_config.model_config.model}"
            # Prompt stores need a step's copies done before the next step is built: synchronous scheduling.
            sync = not vllm_config.scheduler_config.async_scheduling
            self.scheduler = KVPoolScheduler(KVPoolLink(settings, layout, client_name=name[:128]),
                                             layout.block_size, self._blocks_of if sync else None,
                                             vllm_config.scheduler_config.max_num_seqs)
        else:
            self.worker = KVPoolWorker(settings, layout)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return False  # no per-layer hook does any work: whole blocks before and after the forward pass

    # ------------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVPoolConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def _blocks_of(self, req_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "vLLM binds its KV cache manager before scheduling"
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_work()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loaded whole in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # stored whole in start_load_kv, before the loads

    def wait_for_save(self) -> None:
        return  # a step's stores are copied at the start of the next step's start_load_kv

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        return self.worker.worker_meta() if self.worker is not None else None

    def _meta(self) -> KVPoolConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVPoolConnectorMetadata) else None

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.link.close()
        if self.worker is not None:
            self.worker.close()
