"""register / register_prompt / register_prompts / append / fork / free / step over the session's fast-path channel when
the client has one (docs/fast-path.md), else -- a remote server, ``fast_path=False``, ``session=False``, a server
with the fast path off, a record too big for the channel's areas, an argument the record cannot carry, a record
the server does not know -- the same call over gRPC
(commands.py). Same arguments, same results, same exceptions either way; both clients (KVPoolClient, and
AsyncKVPoolClient, whose exchange parks on its event loop) run these plans.

The channel is opened on the first such call, after the session (OpenFastPath names it), and closed by
``close()``. A channel that failed -- a timeout (its request may still be applied: it is out of step), a fence (its
session ended, the server stopped), its socket's end (the server died) -- raised its error for the call in flight
and is given up: later calls go over gRPC and get the server's answer as it now stands.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool import fastpath as fp
from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import fastpath_records as channel_ops
from kvpool_client import convert, fast_args, fast_step, rpcs
from kvpool_client.command import command
from kvpool_client.commands import KVPoolCommands
from kvpool_client.errors import InvalidArgumentError, KVPoolClientError
from kvpool_client.fastpath import FastChannel, error_for, is_local_target
from kvpool_client.plan import Exchange, Plan
from kvpool_client.types import AppendResult, RegisteredSequence, StepResult

logger = logging.getLogger(__name__)
# Records carry no request id: a channel applies each record at most once (its seq), never resends one, and gives
# itself up when a reply does not come (DeadlineExceededError), so the server's reply cache has nothing to replay
# -- and skipping it is a third of the server's work for a decode step. (The record has the field: a client that
# wants replay across transports may fill it.)
NO_REQUEST_ID = 0
MAX_EXTRA_KEY = 4096
UNKNOWN_OP = "fast path: unknown op"  # what a server answers a record it does not know (applied: nothing)


class FastPathCommands(KVPoolCommands):
    """KVPoolCommands with the four steady-state calls over the fast path when it can."""

    def __init__(self, target: str, *, fast_path: bool | None = None, **kwargs: Any) -> None:
        """``fast_path``: True, or None (the default) unless ``channel`` is given (a caller's own channel, its
        interceptors, see every call): the four calls over the session's channel when the server is on this host;
        False: always gRPC. The other arguments: KVPoolCommands'."""
        super().__init__(target, **kwargs)
        enabled = kwargs.get("channel") is None if fast_path is None else fast_path
        self._fast_off = not (enabled and self._session.enabled and is_local_target(target))
        self._fast_channel: FastChannel | None = None
        self._no_register_many = False  # the server refused a register-many record as an unknown op
        self._no_step = False  # the same for a step record
        # The receive limit this client declares to the server (convert.call_metadata): a call whose worst-case
        # reply is over it goes over gRPC, where the server refuses it unapplied -- as it would without the fast path.
        declared = int(dict(self._metadata).get(convert.RECEIVE_LIMIT_KEY, "-1"))
        self._fast_reply_limit = declared if declared >= 0 else 1 << 62

    @property
    def fast_path_enabled(self) -> bool:
        """True when the four steady-state calls go over the fast path (opened by the first of them): the server is
        on this host, sessions are on, and ``fast_path`` did not turn it off."""
        return not self._fast_off

    @property
    def fast_path_open(self) -> bool:
        """True while this client's calls go over a fast-path channel."""
        return self._fast_channel is not None and not self._fast_off

    # ---------------------------------------------------------------- the calls
    @command
    def register(self, seq_id: int | None = None, *, cache_extra_key: bytes = b"",
                 timeout: float | None = None) -> Plan[int]:
        method = rpcs.REGISTER_SEQUENCE.name
        channel = None
        if seq_id != 0 and len(cache_extra_key) <= MAX_EXTRA_KEY:
            channel = yield from self._fast_channel_plan(method, timeout)
        if channel is None:
            return (yield from super().register.__wrapped__(  # type: ignore[attr-defined]
                self, seq_id, cache_extra_key=cache_extra_key, timeout=timeout))
        write = channel_ops.register_writer(channel.generation, seq_id, None, 0, cache_extra_key, NO_REQUEST_ID)
        return (yield from self._exchange(channel, write, channel_ops.read_registered, method, timeout))[0]

    @command
    def register_prompt(self, prompt_token_ids: Sequence[int] | np.ndarray, seq_id: int | None = None, *,
                        public_prefix_len: int = 0, cache_extra_key: bytes = b"",
                        timeout: float | None = None) -> Plan[tuple[int, int]]:
        method = rpcs.REGISTER_SEQUENCE.name
        prompt = fast_args.uint32_tokens(prompt_token_ids)
        channel = None
        need = (0, 0, 0 if prompt is None else prompt.size, len(cache_extra_key), 0)
        if prompt is not None and seq_id != 0 and public_prefix_len >= 0 and len(cache_extra_key) <= MAX_EXTRA_KEY:
            channel = yield from self._fast_channel_plan(method, timeout, need)
        if channel is None or prompt is None:
            return (yield from super().register_prompt.__wrapped__(  # type: ignore[attr-defined]
                self, prompt_token_ids, seq_id, public_prefix_len=public_prefix_len, cache_extra_key=cache_extra_key,
                timeout=timeout))
        write = channel_ops.register_writer(channel.generation, seq_id, prompt, public_prefix_len, cache_extra_key,
                                            NO_REQUEST_ID)
        return (yield from self._exchange(channel, write, channel_ops.read_registered, method, timeout))

    @command
    def register_prompts(self, prompts: Sequence[Sequence[int] | np.ndarray], *,
                         cache_extra_keys: Sequence[bytes] = (),
                         timeout: float | None = None) -> Plan[list[RegisteredSequence]]:
        """One prompt goes over the fast path as a register record, whose reply carries its cached block ids (a
        server that sends none: they are read with ``block_table``); several as one register-many record (the
        server's RegisterSequences: same checks, all or none); what a record cannot carry (or a server that does
        not know the record: refused unapplied) as one RegisterSequences over gRPC."""
        if len(prompts) > 1:
            return (yield from self._register_many(prompts, cache_extra_keys, timeout))
        method = rpcs.REGISTER_SEQUENCE.name
        prompt = fast_args.uint32_tokens(prompts[0]) if len(prompts) == 1 else None
        key = cache_extra_keys[0] if len(cache_extra_keys) == 1 else b""
        channel = None
        need = (0, 0, 0, len(key), 0) if prompt is None else (0, 0, prompt.size, len(key),
                                                                fp.reply_bytes(0, 0, prompt.size, 0, 0))
        if prompt is not None and prompt.size and len(cache_extra_keys) <= 1 and len(key) <= MAX_EXTRA_KEY:
            channel = yield from self._fast_channel_plan(method, timeout, need)
        if channel is None or prompt is None:
            return (yield from super().register_prompts.__wrapped__(  # type: ignore[attr-defined]
                self, prompts, cache_extra_keys=cache_extra_keys, timeout=timeout))
        write = channel_ops.register_writer(channel.generation, None, prompt, 0, key, NO_REQUEST_ID)
        found = yield from self._exchange(channel, write, channel_ops.read_registered_blocks, method, timeout)
        if found[0].num_cached_tokens and not found[0].cached_block_ids.size:  # a server that sends no block ids
            table = yield from super().block_table.__wrapped__(self, found[0].seq_id, timeout=timeout)  # type: ignore[attr-defined]
            cached = np.asarray(table.block_ids, dtype=np.int32)
            found = [RegisteredSequence(found[0].seq_id, found[0].num_cached_tokens, cached)]
        return found

    def _register_many(self, prompts: Sequence[Sequence[int] | np.ndarray], cache_extra_keys: Sequence[bytes],
                       timeout: float | None) -> Plan[list[RegisteredSequence]]:
        """``register_prompts`` of two or more prompts: one register-many record when the channel is open (or
        opens) and the record fits its areas, else RegisterSequences over gRPC."""
        method = rpcs.REGISTER_SEQUENCES.name
        converted = [] if self._fast_off or self._no_register_many else [fast_args.uint32_tokens(p) for p in prompts]
        arrays = [a for a in converted if a is not None]  # all of them, or gRPC gives its error
        keys = list(cache_extra_keys) or [b""] * len(prompts)
        channel, sizes = None, None
        if len(arrays) == len(prompts) == len(keys) and all(len(k) <= MAX_EXTRA_KEY for k in keys):
            n_tokens = int(sum(a.size for a in arrays))
            sizes = (len(prompts), 2 * len(prompts), n_tokens, sum(len(k) for k in keys),
                     fp.register_many_reply_bytes(len(prompts), n_tokens))  # a block id per token at most
            channel = yield from self._fast_channel_plan(method, timeout, sizes)
        if channel is not None and sizes is not None:
            write = channel_ops.register_many_writer(channel.generation, arrays, keys, NO_REQUEST_ID)
            try:
                return (yield from self._exchange(channel, write, channel_ops.read_registered_many, method, timeout))
            except InvalidArgumentError as error:
                if not error.details.startswith(UNKNOWN_OP):
                    raise
                self._no_register_many = True  # a server without the record refused it unapplied: gRPC from now on
        return (yield from super().register_prompts.__wrapped__(  # type: ignore[attr-defined]
            self, prompts, cache_extra_keys=cache_extra_keys, timeout=timeout))

    @command
    def append(self, seq_ids: int | Sequence[int] | np.ndarray, num_tokens: int | Sequence[int] | np.ndarray = 1,
               *, token_ids: Sequence[int] | np.ndarray | None = None,
               timeout: float | None = None) -> Plan[AppendResult]:
        method = rpcs.APPEND_TOKEN.name
        args = None if self._fast_off else fast_args.append_args(seq_ids, num_tokens)  # None: gRPC's path gives its error
        tokens = fast_args.uint32_tokens(token_ids) if token_ids is not None and args is not None else None
        channel = None
        if args is not None and (tokens is not None or token_ids is None):
            n_tokens = 0 if tokens is None else tokens.size
            need = (len(args[0]), args[3].size, n_tokens, 0, fp.append_reply_bound(len(args[0]), args[4], 1))
            channel = self._usable_channel(method, need)  # the decode loop's case: no generator to go through
            if channel is None:
                channel = yield from self._fast_channel_plan(method, timeout, need)
        if channel is None or args is None:
            return (yield from super().append.__wrapped__(  # type: ignore[attr-defined]
                self, seq_ids, num_tokens, token_ids=token_ids, timeout=timeout))
        ids, id_array, counts, counts_field, _ = args
        write = channel_ops.append_writer(channel.generation, id_array, counts_field, tokens, NO_REQUEST_ID)
        sent_at = time.monotonic()  # ``_exchange``'s, inline: the decode step's call
        answer = yield Exchange(channel, write, channel_ops.append_reader(ids, counts), method,
                                self.timeout if timeout is None else timeout)
        self._session.acked(sent_at)  # the server renewed the lease after sent_at
        return answer

    @command
    def fork(self, parent_seq_id: int, num_children: int = 0, child_seq_ids: Sequence[int] = (), *,
             timeout: float | None = None) -> Plan[list[int]]:
        method = rpcs.FORK.name
        children = list(child_seq_ids)
        channel = None
        need = (len(children), 0, 0, 0, fp.reply_bytes(0, 0, 0, 0, max(num_children, len(children))))
        if 0 <= num_children < (1 << 32) and 0 < parent_seq_id < (1 << 64) and fast_args.uint64_ok(children):
            channel = yield from self._fast_channel_plan(method, timeout, need)
        if channel is None:
            return (yield from super().fork.__wrapped__(  # type: ignore[attr-defined]
                self, parent_seq_id, num_children, child_seq_ids, timeout=timeout))
        write = channel_ops.fork_writer(channel.generation, parent_seq_id, num_children, children, NO_REQUEST_ID)
        return (yield from self._exchange(channel, write, channel_ops.read_children, method, timeout))

    @command
    def free(self, seq_ids: int | Sequence[int], *, timeout: float | None = None) -> Plan[int]:
        method = rpcs.FREE.name
        ids = [int(seq_ids)] if isinstance(seq_ids, (int, np.integer)) else list(seq_ids)
        channel = None
        need = (len(ids), 0, 0, 0, 0)
        if not self._fast_off and fast_args.uint64_ok(ids):
            channel = yield from self._fast_channel_plan(method, timeout, need)
        if channel is None:
            return (yield from super().free.__wrapped__(self, seq_ids, timeout=timeout))  # type: ignore[attr-defined]
        write = channel_ops.free_writer(channel.generation, [int(i) for i in ids], NO_REQUEST_ID)
        return (yield from self._exchange(channel, write, channel_ops.read_freed, method, timeout))

    @command
    def step(self, free: Sequence[int] = (), append: fast_step.Append | None = None,
             register: fast_step.Register | None = None, *, timeout: float | None = None) -> Plan[StepResult]:
        """One step record (fast_step.py) when the channel is open (or opens) and the record fits its areas; else
        -- or for a server that does not know the record (refused unapplied) -- the three calls one by one."""
        if not (len(free) or append is not None or register is not None):
            return StepResult()
        record = None if self._fast_off or self._no_step else fast_step.record_of(free, append, register)
        channel = None if record is None else (yield from self._fast_channel_plan(fast_step.METHOD, timeout,
                                                                                  record.need))
        if channel is not None and record is not None:
            read = fast_step.reader(record, bool(len(free)), append is not None, register is not None, error_for)
            try:
                return (yield from self._exchange(channel, fast_step.writer(channel.generation, record), read,
                                                  fast_step.METHOD, timeout))
            except InvalidArgumentError as error:
                if not error.details.startswith(UNKNOWN_OP):
                    raise
                self._no_step = True  # a server without the record refused it unapplied: the calls one by one
        return (yield from fast_step.separate(self, free, append, register, timeout))

    # ---------------------------------------------------------------- plumbing
    def _fast_channel_plan(self, method: str, timeout: float | None,
                           need: tuple[int, int, int, int, int] | None = None) -> Plan[FastChannel | None]:
        """The channel, opening the session and the channel on first use; None: use gRPC -- also when the record
        (``need``: its ids, counts, tokens, extra bytes and worst-case reply) does not fit the channel's areas, or
        its reply is over the limit this client declares to the server (convert.call_metadata: over gRPC the
        server refuses it unapplied, as it would without the fast path)."""
        if self._fast_off or (need is not None and need[4] > self._fast_reply_limit):
            return None
        session = yield from self._session_fields(method, timeout)
        if not session:
            return None
        channel = self._fast_channel
        if channel is not None and (channel.broken is not None or channel.fenced):
            # Out of step (a timeout), or closed by the server (its session ended, it stopped, it died): gRPC from
            # now on, which answers as the server now stands (SessionLostError, ServerRestartedError, UNAVAILABLE).
            self._close_fast_path()
            return None
        if channel is None:
            try:
                response = yield from self._call(rpcs.OPEN_FAST_PATH,
                                                 pb.OpenFastPathRequest(session_id=session["session_id"]), timeout)
                if self._fast_channel is None and not self._fast_off:  # another call of this client may have
                    self._fast_channel = FastChannel.connect(response)
            except (KVPoolClientError, OSError, ValueError) as exc:
                logger.info("kvpool fast path not used (gRPC instead): %s", exc)
                self._fast_off = True
            channel = None if self._fast_off else self._fast_channel
        if channel is not None and need is not None and not channel.fits(*need):
            return None
        return channel

    def _usable_channel(self, method: str, need: tuple[int, int, int, int, int]) -> FastChannel | None:
        """The open channel when ``_fast_channel_plan`` would answer it without a step (its session open and live,
        the channel usable, the record fitting), after the same checks; None: ask ``_fast_channel_plan``."""
        channel, state = self._fast_channel, self._session
        if channel is None or self._fast_off or need[4] > self._fast_reply_limit or not state.enabled or \
                state.session_id is None:
            return None
        state.check_live(method)  # raises what ended the session, as ``_session_fields`` does
        if channel.broken is not None or channel.fenced or not channel.fits(*need):
            return None
        return channel

    def _exchange(self, channel: FastChannel, write: Any, read: Any, method: str, timeout: float | None) -> Plan[Any]:
        sent_at = time.monotonic()
        answer = yield Exchange(channel, write, read, method, self.timeout if timeout is None else timeout)
        self._session.acked(sent_at)  # the server renewed the lease after sent_at
        return answer

    def _close_fast_path(self) -> None:
        channel, self._fast_channel = self._fast_channel, None
        self._fast_off = True
        if channel is not None:
            channel.close()
