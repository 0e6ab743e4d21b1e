"""kvpool as vLLM's KV connector: ``kv_connector_module_path = "kvpool_client.integrations.vllm"``,
``kv_connector = "KVPoolConnector"`` (docs/vllm.md). Needs vLLM (>= 0.32 with the v1 connector API)."""

try:
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(f"kvpool_client.integrations.vllm needs vLLM installed ({error})") from error

from .connector import KVPoolConnector
from .metadata import KVPoolConnectorMetadata, KVPoolWorkerMetadata

__all__ = ["KVPoolConnector", "KVPoolConnectorMetadata", "KVPoolWorkerMetadata"]
