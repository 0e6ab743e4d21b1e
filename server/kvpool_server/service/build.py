"""build_service(config): the pool, the core and the service over them, every part given its dependencies once,
in its constructor -- the whole server below any transport (grpc_api/server.py adds gRPC around it)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from kvpool.tensor_parallel import group_block_bytes
from kvpool_server.config import ConfigError, ServerConfig
from kvpool_server.host_checks import check_environment, check_pool_fits, pool_error_message
from kvpool_server.offload.create import create_tier_pool
from kvpool_server.offload.host_tier import HostTier
from kvpool_server.offload.tier_copies import TierCopies
from kvpool_server.core import KVCacheManager, KVPoolError
from kvpool_server.core.sessions import SessionTable, new_server_epoch
from kvpool_server.device import create_pool
from kvpool_server.service.admission import Admission
from kvpool_server.service.auth import Authenticator, TokensFileError
from kvpool_server.service.events import EventFeed
from kvpool_server.service.guard import CoreGuard
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.metrics import KVPoolMetrics
from kvpool_server.service.replay import ReplyCache
from kvpool_server.service.sessions import SessionService
from kvpool_server.shm_segments import reap_stale_segments


class StartupError(RuntimeError):
    """The server cannot start (address in use, no GPU, ...); the message says why."""


def build_service(config: ServerConfig, *, metrics: KVPoolMetrics | None = None,
                  on_drain: Callable[[bool], None] = lambda draining: None) -> tuple[KVPoolService, Admission]:
    """Allocate the pool and build the core and the service over it, and the admission every transport's calls
    pass. Raises StartupError, with nothing left allocated, if the pool cannot be made or the configuration does
    not fit it."""
    config.validate()
    reap_stale_segments()  # dead servers' pools and channels, before the free space of /dev/shm is looked at
    try:
        check_environment(config)
        check_pool_fits(config)
    except ConfigError as exc:
        raise StartupError(str(exc)) from exc
    try:
        size: Any = config.pool_size_kwargs()
        pool = create_pool(config.layout, backend=config.backend, tensor_parallel=config.tensor_parallel,
                           devices=config.tp_device_list(), **size)
    except Exception as exc:
        raise StartupError(pool_error_message(config.backend, exc)) from exc
    try:
        # a block's bytes over every rank (more than the layout's when heads are replicated): the tier's slot
        tier_blocks = config.host_tier_bytes // group_block_bytes(config.layout, config.tensor_parallel)
        manager = KVCacheManager(
            pool.num_blocks, config.block_size, max_seq_len=config.max_seq_len, max_num_seqs=config.max_num_seqs,
            tenancy=bool(config.auth_tokens),
            prefix_eviction=config.prefix_eviction, prefix_half_life_tokens=config.prefix_eviction_half_life_tokens,
        )
        auth = Authenticator(config.auth_tokens, manager.tenants, manager.num_blocks) if config.auth_tokens else None
        sessions = SessionTable(new_server_epoch(), default_ttl_s=config.session_ttl_ms / 1000.0,
                                max_ttl_s=config.max_session_ttl_ms / 1000.0)
        # the host tier's bookkeeping over the manager's pool (its memory comes after the guard: start_host_tier)
        host_tier = HostTier(manager, tier_blocks, num_ready=0) if tier_blocks else None
        events = EventFeed(sessions.server_epoch, manager.allocator.cache, config.event_buffer_batches,
                           medium="GPU" if pool.backend == "gpu" else "CPU",
                           max_subscribers=config.max_event_subscribers, max_bytes=config.event_buffer_bytes,
                           # without tokens every caller is one tenant: only --max-event-subscribers bounds
                           max_subscribers_per_tenant=config.max_event_subscribers_per_tenant if config.auth_tokens
                           else None,
                           kept=host_tier.stored_events if host_tier is not None else list)
        guard = CoreGuard(manager, pool, sessions, ReplyCache(), events)
        tier = start_host_tier(host_tier, pool, guard.lock) if host_tier is not None else None
        if tier is not None and config.host_tier_writeback_blocks:
            tier.start_writeback(guard.lock, config.host_tier_writeback_blocks, publish=guard.events.publish)
        sessions_service = SessionService(guard, metrics, on_drain, max_sessions=config.max_sessions,
                                          max_message_bytes=config.max_message_bytes)
        service = KVPoolService(
            guard, sessions_service, auth=auth, metrics=metrics, max_batch=config.max_batch,
            max_message_bytes=config.max_message_bytes, max_tokens_per_call=config.max_tokens_per_call,
            max_inflight_bytes=config.max_inflight_bytes, tier=tier,
        )
        return service, Admission()
    except TokensFileError as exc:
        pool.close()
        raise StartupError(str(exc)) from exc
    except KVPoolError as exc:
        pool.close()
        raise StartupError(f"bad pool configuration: {exc}") from exc
    except BaseException:
        pool.close()
        raise


def start_host_tier(tier: HostTier, pool: Any, lock: AbstractContextManager) -> TierCopies:
    """The host tier (``--host-tier-bytes``) of the pool under ``tier``'s bookkeeping: its memory allocated in the
    background (serving starts at once), each chunk handed to the bookkeeping under ``lock`` (the guard's) as it is
    there."""

    def on_ready(num_ready: int) -> None:
        with lock:
            tier.make_ready(num_ready)

    return TierCopies(tier, create_tier_pool(pool, tier.num_slots, on_ready=on_ready))
