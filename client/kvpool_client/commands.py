"""The client API, every call written once: KVPoolClient (client.py) and AsyncKVPoolClient (aio.py) inherit these
methods and differ only in how they open a channel and run a plan (plan.py): blocking, or awaited.

A command checks its arguments and builds the request (convert.py), makes its RPC (a row of rpcs.py) through the
retry loop (retry.py), and parses the response into types.py (convert.py again)::

    @command
    def free(self, seq_ids, *, timeout=None) -> Plan[int]:
        session = yield from self._session_fields(rpcs.FREE.name, timeout)
        response = yield from self._call(rpcs.FREE, convert.free_request(seq_ids, **session), timeout)
        return response.num_blocks_freed

On KVPoolClient ``client.free(ids)`` returns that int; on AsyncKVPoolClient it returns an awaitable of it.
Every call has a deadline: the client's ``timeout`` unless the call passes its own.
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import numpy as np
from grpc_health.v1 import health_pb2_grpc

from kvpool.layout import KVLayout
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_client import convert, diagnose, fast_step, rpcs
from kvpool_client.errors import (ConnectionFailedError, DeadlineExceededError, InvalidArgumentError, KVPoolClientError,
                                  UnavailableError)
from kvpool_client.command import command
from kvpool_client.plan import Pause, Plan
from kvpool_client.retry import RetryPolicy, call_with_retries
from kvpool_client.session import SessionState
from kvpool_client.session_commands import SessionCommands
from kvpool_client.types import (
    AppendResult,
    BlockTable,
    InvariantReport,
    PoolDescription,
    PoolStats,
    RegisteredSequence,
    StepResult,
)

P = ParamSpec("P")
R = TypeVar("R")
HEALTH_POLL_S = 0.05


class KVPoolCommands(SessionCommands, ABC):
    """The API over one channel. A subclass supplies ``_open_channel`` (sync or grpc.aio) and ``_run``."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        options: Sequence[tuple[str, Any]] = (),
        channel: Any = None,
        session: bool = True,
        client_name: str | None = None,
        lease_ttl_s: float | None = None,
        token: str | None = None,
        tls_ca: str | bytes | None = None,
        tls_cert: str | bytes | None = None,
        tls_key: str | bytes | None = None,
    ) -> None:
        """``channel``: an open grpc.Channel (KVPoolClient) or grpc.aio.Channel (AsyncKVPoolClient) to use instead
        of opening one to ``target``; ``options`` are added to the channel's (convert.channel_options).

        ``session`` (default on): the client opens a session on its first call that creates or changes sequences,
        keeps it alive in the background and closes it in ``close()``; every sequence it registers or forks is
        freed when the session ends -- closed, or its process dead (session.py). ``client_name`` names it in
        ListSessions (default host:pid); ``lease_ttl_s`` asks for a lease (default: the server's).
        ``session=False``: sequences live until freed, whoever dies (and mutations are not retried).

        ``token``: sent as ``authorization: Bearer <token>`` on every call (a server with --auth-tokens). ``tls_ca``
        (PEM bytes or a file path): TLS, trusting that CA; ``tls_cert``/``tls_key``: this client's certificate for
        mutual TLS (docs/security.md)."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if channel is None and (path := diagnose.path_message(target, diagnose.LIBRARY)) is not None:
            raise InvalidArgumentError(path, method="KVPoolClient")  # gRPC would look it up as a host name
        self.target = target
        self.timeout = timeout
        self.retry = retry
        options = convert.channel_options(options)
        credentials = convert.channel_credentials(tls_ca, tls_cert, tls_key)
        self._tls = credentials is not None
        self._channel = channel or self._open_channel(target, options, credentials)
        self._metadata = convert.call_metadata(options) if channel is None else ()  # unknown limit: 4 MiB assumed
        self._auth_metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._metadata += self._auth_metadata
        self._stub = pb_grpc.KVPoolServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._description: PoolDescription | None = None
        self._session = SessionState(session, client_name, lease_ttl_s)

    # ---------------------------------------------------------------- what a client supplies
    @staticmethod
    @abstractmethod
    def _open_channel(target: str, options: list[tuple[str, Any]], credentials: Any = None) -> Any: ...

    @abstractmethod
    def _run(self, plan: Plan[R]) -> Any:
        """Run ``plan`` to its result (KVPoolClient), or return an awaitable of it (AsyncKVPoolClient)."""

    def _keep_alive_method(self) -> Any:
        """The KeepAlive stub method, carrying the token when there is one."""
        if not self._auth_metadata:
            return self._stub.KeepAlive
        return functools.partial(self._stub.KeepAlive, metadata=self._auth_metadata)

    # ---------------------------------------------------------------- plumbing
    def _explain(self, error: KVPoolClientError) -> KVPoolClientError:
        """A failure to connect, explained as kvctl explains it (diagnose.py), in this library's words."""
        if type(error) is not UnavailableError or not diagnose.is_connect_failure(error.details):
            return error
        problem = diagnose.explain(self.target, error.details, self._tls, diagnose.LIBRARY)
        return ConnectionFailedError(f"{problem.message} (gRPC: {error.details})", grpc_details=error.details,
                                     permanent=problem.permanent, method=error.method)

    def _stub_method(self, rpc: rpcs.Rpc) -> Callable:
        return getattr(self._health if rpc.stub == rpcs.HEALTH_STUB else self._stub, rpc.stub_method)

    def _call(self, rpc: rpcs.Rpc, request: Any, timeout: float | None) -> Plan[Any]:
        sent_at = time.monotonic()
        response = yield from call_with_retries(rpc, request, self.timeout if timeout is None else timeout, self.retry)
        if rpc.renews_lease and request.session_id and request.session_id == self._session.session_id:
            self._session.acked(sent_at)  # the server renewed the lease after sent_at (session.py)
        return response

    # ---------------------------------------------------------------- sequences
    @command
    def register(self, seq_id: int | None = None, *, cache_extra_key: bytes = b"",
                 timeout: float | None = None) -> Plan[int]:
        """Create an empty sequence; the server assigns the id (never reused) unless ``seq_id`` is given.
        ``cache_extra_key`` (prefix caching): goes into the hash of each of its blocks once its appends carry
        token ids (a LoRA adapter's name, a digest of multimodal inputs; at most 256 bytes)."""
        session = yield from self._session_fields(rpcs.REGISTER_SEQUENCE.name, timeout)
        request = convert.register_request(seq_id, cache_extra_key=cache_extra_key, **session)
        response = yield from self._call(rpcs.REGISTER_SEQUENCE, request, timeout)
        return response.seq_id

    @command
    def register_prompt(
        self, prompt_token_ids: Sequence[int] | np.ndarray, seq_id: int | None = None, *,
        public_prefix_len: int = 0, cache_extra_key: bytes = b"", timeout: float | None = None,
    ) -> Plan[tuple[int, int]]:
        """Create a sequence for a prompt (prefix caching, docs/prefix-caching.md): it starts with the prompt's
        longest cached run of full blocks. Returns (seq_id, num_cached_tokens); the caller appends the rest of the
        prompt with its ``token_ids``. ``public_prefix_len``: the prompt's first tokens whose full blocks are
        shared across tenants (needs the tenant's ``share_prefixes``); ``cache_extra_key``: goes into every block's
        hash (a LoRA adapter's name, a digest of multimodal inputs; at most 256 bytes)."""
        session = yield from self._session_fields(rpcs.REGISTER_SEQUENCE.name, timeout)
        request = convert.register_request(seq_id, public_prefix_len=public_prefix_len,
                                           cache_extra_key=cache_extra_key, **session)
        request.prompt_token_ids.extend(np.asarray(prompt_token_ids, dtype=np.uint32).tolist())
        response = yield from self._call(rpcs.REGISTER_SEQUENCE, request, timeout)
        return response.seq_id, response.num_cached_tokens

    @command
    def register_prompts(self, prompts: Sequence[Sequence[int] | np.ndarray], *,
                         cache_extra_keys: Sequence[bytes] = (),
                         timeout: float | None = None) -> Plan[list[RegisteredSequence]]:
        """``register_prompt`` for each prompt, in one call (RegisterSequences, over gRPC): all are registered or
        none (the first refusal's error). Each answer carries its cached blocks (no ``block_table`` call needed).
        At most the server's --max-batch prompts and --max-tokens-per-call tokens in all. ``cache_extra_keys``:
        one per prompt, or none."""
        session = yield from self._session_fields(rpcs.REGISTER_SEQUENCES.name, timeout)
        request = convert.register_many_request(prompts, cache_extra_keys, **session)
        response = yield from self._call(rpcs.REGISTER_SEQUENCES, request, timeout)
        return convert.registered_sequences(response)

    @command
    def append(
        self,
        seq_ids: int | Sequence[int] | np.ndarray,
        num_tokens: int | Sequence[int] | np.ndarray = 1,
        *,
        token_ids: Sequence[int] | np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Plan[AppendResult]:
        """Grow every sequence of ``seq_ids`` by ``num_tokens`` (one count for all, or one each), atomically.
        ``token_ids``: the appended tokens' ids, all sequences' concatenated in order (prefix caching), or None."""
        ids, counts, counts_field = convert.append_args(seq_ids, num_tokens, rpcs.APPEND_TOKEN.name)
        session = yield from self._session_fields(rpcs.APPEND_TOKEN.name, timeout)
        request = pb.AppendTokenRequest(seq_ids=ids, num_tokens=counts_field, **session)
        if token_ids is not None:
            request.token_ids.extend(np.asarray(token_ids, dtype=np.uint32).tolist())
        response = yield from self._call(rpcs.APPEND_TOKEN, request, timeout)
        return convert.append_result(ids, counts, response)

    @command
    def fork(
        self,
        parent_seq_id: int,
        num_children: int = 0,
        child_seq_ids: Sequence[int] = (),
        *,
        timeout: float | None = None,
    ) -> Plan[list[int]]:
        """Children that share every block of the parent (copy-on-write); returns their ids."""
        session = yield from self._session_fields(rpcs.FORK.name, timeout)
        request = convert.fork_request(parent_seq_id, num_children, child_seq_ids, **session)
        response = yield from self._call(rpcs.FORK, request, timeout)
        return list(response.child_seq_ids)

    @command
    def free(self, seq_ids: int | Sequence[int], *, timeout: float | None = None) -> Plan[int]:
        """Release sequences (all or none); returns the number of blocks whose ref count reached 0."""
        session = yield from self._session_fields(rpcs.FREE.name, timeout)
        response = yield from self._call(rpcs.FREE, convert.free_request(seq_ids, **session), timeout)
        return response.num_blocks_freed

    @command
    def step(self, free: Sequence[int] = (), append: fast_step.Append | None = None,
             register: fast_step.Register | None = None, *, timeout: float | None = None) -> Plan[StepResult]:
        """A scheduler's step: ``free`` (seq ids), then ``append`` ((seq ids, a count each, token ids or None)),
        then ``register`` ((prompts, a cache_extra_key each or none)), as ``free``, ``append`` and
        ``register_prompts`` would make them -- in one round trip over the fast path (one step record), else the
        three calls one after the other. Each part's answer, or the error it was refused with (the parts after
        it are still made): a ``StepResult`` (fast_step.py)."""
        if not (len(free) or append is not None or register is not None):
            return StepResult()
        return (yield from fast_step.separate(self, free, append, register, timeout))

    # ---------------------------------------------------------------- reads (retried on UNAVAILABLE)
    @command
    def stats(self, *, timeout: float | None = None) -> Plan[PoolStats]:
        response = yield from self._call(rpcs.STATS, pb.StatsRequest(), timeout)
        return convert.pool_stats(response)

    @command
    def block_table(self, seq_id: int, *, timeout: float | None = None) -> Plan[BlockTable]:
        response = yield from self._call(rpcs.GET_BLOCK_TABLE, pb.GetBlockTableRequest(seq_id=seq_id), timeout)
        return convert.block_table(response)

    @command
    def describe_pool(self, *, timeout: float | None = None) -> Plan[PoolDescription]:
        return (yield from self._describe_pool(timeout))

    def _describe_pool(self, timeout: float | None) -> Plan[PoolDescription]:
        response = yield from self._call(rpcs.DESCRIBE_POOL, pb.DescribePoolRequest(), timeout)
        self._description = convert.pool_description(response)
        self._session.server_pid = self._description.server_pid
        return self._description

    def _layout(self) -> Plan[KVLayout]:
        """The pool's layout (fetched once: it is fixed for the life of a server)."""
        return (self._description or (yield from self._describe_pool(None))).layout

    @command
    def read_kv(
        self, seq_id: int, start: int = 0, num_tokens: int = 0, *, timeout: float | None = None
    ) -> Plan[np.ndarray]:
        """KV of tokens [start, start + num_tokens) (0: to the end) as [n, num_layers, 2, num_kv_heads, head_dim]."""
        response = yield from self._call(rpcs.READ_KV, convert.read_kv_request(seq_id, start, num_tokens), timeout)
        return convert.kv_array(response, (yield from self._layout()))

    @command
    def check_invariants(self, *, timeout: float | None = None) -> Plan[InvariantReport]:
        """The server's full invariant check; a violation raises InternalError with the server's message."""
        response = yield from self._call(rpcs.CHECK_INVARIANTS, pb.CheckInvariantsRequest(), timeout)
        return convert.invariant_report(response)

    @command
    def health(self, service: str = "", *, timeout: float | None = None) -> Plan[str]:
        """The standard health check's status name: "SERVING", "NOT_SERVING", ..."""
        return (yield from self._health_status(service, timeout))

    def _health_status(self, service: str, timeout: float | None) -> Plan[str]:
        response = yield from self._call(rpcs.HEALTH_CHECK, convert.health_request(service), timeout)
        return convert.health_status(response)

    @command
    def wait_until_serving(self, timeout: float = 10.0, service: str = "") -> Plan[None]:
        """Return once health says SERVING; raise DeadlineExceededError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                last = yield from self._health_status(service, max(0.05, min(1.0, deadline - time.monotonic())))
                if last == "SERVING":
                    return
            except (UnavailableError, DeadlineExceededError) as error:
                last = str(error)
            yield Pause(HEALTH_POLL_S)
        raise DeadlineExceededError(f"server at {self.target} not SERVING after {timeout}s ({last})", method="Health")

    # ---------------------------------------------------------------- KV through the page table (remote path)
    @command
    def write_kv(self, seq_id: int, start: int, data: np.ndarray, *, timeout: float | None = None) -> Plan[int]:
        """Write ``data`` ([n, num_layers, 2, num_kv_heads, head_dim], the pool's storage dtype) to tokens
        [start, start + n) of a sequence; returns n. The tokens' blocks must be the sequence's own."""
        session = yield from self._session_fields(rpcs.WRITE_KV.name, timeout)
        request = convert.write_kv_request(seq_id, start, data, (yield from self._layout()), session.get("session_id", 0))
        response = yield from self._call(rpcs.WRITE_KV, request, timeout)
        return response.num_tokens_written
