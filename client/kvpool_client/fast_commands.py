"""KVPoolClient's register / register_prompt / append / fork / free over the session's fast-path channel when it
has one (docs/fast-path.md), else -- a remote server, ``fast_path=False``, ``session=False``, a server with the fast
path off, a record too big for the channel's areas, an argument the record cannot carry -- the same call over gRPC
(commands.py). Same arguments, same results, same exceptions either way.

The channel is opened on the first such call, after the session (OpenFastPath names it), and closed by
``close()``. A channel that timed out is given up for gRPC (its request may still be applied: it is out of step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool import fastpath as fp
from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import convert, rpcs
from kvpool_client.errors import DeadlineExceededError, KVPoolClientError
from kvpool_client.fastpath import FastChannel, is_local_target
from kvpool_client.types import AppendResult

logger = logging.getLogger(__name__)
# Records carry no request id: a channel applies each record at most once (its seq), never resends one, and gives
# itself up when a reply does not come (DeadlineExceededError), so the server's reply cache has nothing to replay
# -- and skipping it is a third of the server's work for a decode step. (The record has the field: a client that
# wants replay across transports may fill it.)
NO_REQUEST_ID = 0


class FastPathCommands:
    """A mixin before KVPoolCommands (``class KVPoolClient(FastPathCommands, KVPoolCommands)``)."""

    _session: Any
    timeout: float
    target: str

    def _init_fast_path(self, enabled: bool) -> None:
        self._fast_off = not (enabled and self._session.enabled and is_local_target(self.target))
        self._fast_channel: FastChannel | None = None
        self._fast_lock = threading.Lock()

    @property
    def fast_path_open(self) -> bool:
        """True while this client's calls go over a fast-path channel."""
        return self._fast_channel is not None and not self._fast_off

    # ---------------------------------------------------------------- the calls
    def register(self, seq_id: int | None = None, *, cache_extra_key: bytes = b"",
                 timeout: float | None = None) -> int:
        if seq_id != 0 and len(cache_extra_key) <= 4096:
            fast = self._fast(rpcs.REGISTER_SEQUENCE.name, timeout)
            if fast is not None:
                channel, t = fast
                return self._fast_call(lambda: channel.register(seq_id, None, 0, cache_extra_key, NO_REQUEST_ID,
                                                                rpcs.REGISTER_SEQUENCE.name, t))[0]
        return super().register(seq_id, cache_extra_key=cache_extra_key, timeout=timeout)  # type: ignore[misc]

    def register_prompt(self, prompt_token_ids: Sequence[int] | np.ndarray, seq_id: int | None = None, *,
                        public_prefix_len: int = 0, cache_extra_key: bytes = b"",
                        timeout: float | None = None) -> tuple[int, int]:
        prompt = _uint32(prompt_token_ids)
        if prompt is not None and seq_id != 0 and public_prefix_len >= 0 and len(cache_extra_key) <= 4096 and \
                self._fits(0, 0, prompt.size, len(cache_extra_key)):
            fast = self._fast(rpcs.REGISTER_SEQUENCE.name, timeout)
            if fast is not None:
                channel, t = fast
                return self._fast_call(lambda: channel.register(seq_id, prompt, public_prefix_len, cache_extra_key,
                                                                NO_REQUEST_ID, rpcs.REGISTER_SEQUENCE.name, t))
        return super().register_prompt(  # type: ignore[misc]
            prompt_token_ids, seq_id, public_prefix_len=public_prefix_len, cache_extra_key=cache_extra_key,
            timeout=timeout)

    def append(self, seq_ids: int | Sequence[int] | np.ndarray, num_tokens: int | Sequence[int] | np.ndarray = 1,
               *, token_ids: Sequence[int] | np.ndarray | None = None, timeout: float | None = None) -> AppendResult:
        if not self._fast_off:
            method = rpcs.APPEND_TOKEN.name
            args = _append_args(seq_ids, num_tokens)  # None: let gRPC's path give its error
            tokens = _uint32(token_ids) if token_ids is not None else None
            if args is not None and (tokens is not None or token_ids is None):
                ids, id_array, counts, counts_field = args
                n_tokens = 0 if tokens is None else tokens.size
                if self._fits(len(ids), counts_field.size, n_tokens):
                    fast = self._fast(method, timeout)
                    if fast is not None:
                        channel, t = fast
                        if channel.fits(0, 0, 0, reply=fp.append_reply_bound(len(ids), int(counts.sum()), 1)):
                            return self._fast_call(lambda: channel.append(ids, id_array, counts, counts_field,
                                                                          tokens, NO_REQUEST_ID, method, t))
        return super().append(seq_ids, num_tokens, token_ids=token_ids, timeout=timeout)  # type: ignore[misc]

    def fork(self, parent_seq_id: int, num_children: int = 0, child_seq_ids: Sequence[int] = (), *,
             timeout: float | None = None) -> list[int]:
        children = list(child_seq_ids)
        if 0 <= num_children < (1 << 32) and 0 < parent_seq_id < (1 << 64) and _uint64_ok(children) and \
                self._fits(len(children), 0, 0):
            fast = self._fast(rpcs.FORK.name, timeout)
            if fast is not None:
                channel, t = fast
                return self._fast_call(lambda: channel.fork(parent_seq_id, num_children, children, NO_REQUEST_ID,
                                                            rpcs.FORK.name, t))
        return super().fork(parent_seq_id, num_children, child_seq_ids, timeout=timeout)  # type: ignore[misc]

    def free(self, seq_ids: int | Sequence[int], *, timeout: float | None = None) -> int:
        if not self._fast_off:
            ids = convert.seq_id_list(seq_ids)
            if _uint64_ok(ids) and self._fits(len(ids), 0, 0):
                fast = self._fast(rpcs.FREE.name, timeout)
                if fast is not None:
                    channel, t = fast
                    return self._fast_call(lambda: channel.free(ids, NO_REQUEST_ID, rpcs.FREE.name, t))
        return super().free(seq_ids, timeout=timeout)  # type: ignore[misc]

    # ---------------------------------------------------------------- plumbing
    def _fits(self, n_ids: int, n_counts: int, n_tokens: int, extra: int = 0) -> bool:
        channel = self._fast_channel
        return channel is None or channel.fits(n_ids, n_counts, n_tokens, extra)

    def _fast(self, method: str, timeout: float | None) -> tuple[FastChannel, float] | None:
        """(the channel, the call's timeout), opening the session and the channel on first use; None:
        use gRPC."""
        if self._fast_off:
            return None
        session = self._run(self._session_fields(method, timeout))  # type: ignore[attr-defined]
        if not session:
            return None
        channel = self._fast_channel or self._open_fast_path(session["session_id"], timeout)
        if channel is None:
            return None
        return channel, self.timeout if timeout is None else timeout

    def _open_fast_path(self, session_id: int, timeout: float | None) -> FastChannel | None:
        with self._fast_lock:
            if self._fast_channel is not None or self._fast_off:
                return self._fast_channel
            try:
                response = self._run(self._call(  # type: ignore[attr-defined]
                    rpcs.OPEN_FAST_PATH, pb.OpenFastPathRequest(session_id=session_id), timeout))
                self._fast_channel = FastChannel.connect(response)
            except (KVPoolClientError, OSError, ValueError) as exc:
                logger.info("kvpool fast path not used (gRPC instead): %s", exc)
                self._fast_off = True
            return self._fast_channel

    def _fast_call(self, exchange: Any) -> Any:
        sent_at = time.monotonic()
        try:
            answer = exchange()
        except DeadlineExceededError:
            self._fast_off = True  # out of step with the server: gRPC from now on
            raise
        self._session.acked(sent_at)  # the server renewed the lease after sent_at
        return answer

    def _close_fast_path(self) -> None:
        channel, self._fast_channel = self._fast_channel, None
        self._fast_off = True
        if channel is not None:
            channel.close()


def _uint32(values: Any) -> np.ndarray | None:
    """``values`` as uint32 token ids, or None when they are not (gRPC then gives its own error)."""
    try:
        array = np.asarray(values)
        if array.ndim != 1 or (array.size and (array.dtype.kind not in "iu" or array.min() < 0 or
                                               array.max() >= 1 << 32)):
            return None
        return array.astype(np.uint32, copy=False)
    except (TypeError, ValueError, OverflowError):
        return None


def _uint64_ok(ids: list[int]) -> bool:
    """Every id fits a uint64 (else gRPC gives its own error)."""
    try:
        np.asarray(ids, dtype=np.uint64)
    except (OverflowError, ValueError, TypeError):
        return False
    return True


def _append_args(seq_ids: Any, num_tokens: Any) -> tuple[tuple[int, ...], np.ndarray, np.ndarray, np.ndarray] | None:
    """(ids, ids as uint64, one count per id, the counts the record carries), cheaper than convert.append_args
    for a decode step; None for anything unusual (gRPC's path then raises its own error)."""
    try:
        if isinstance(seq_ids, (int, np.integer)):
            seq_ids = [int(seq_ids)]
        id_array = np.asarray(seq_ids, dtype=np.uint64)
        if id_array.ndim != 1 or id_array.size == 0:
            return None
        ids = tuple(seq_ids) if isinstance(seq_ids, (list, tuple)) else tuple(id_array.tolist())
        if isinstance(num_tokens, (int, np.integer)):
            if num_tokens < 1 or num_tokens >= 1 << 32:
                return None
            counts = np.full(id_array.size, int(num_tokens), dtype=np.int64)
            return ids, id_array, counts, np.array([num_tokens], dtype=np.uint32)
        counts = np.asarray(num_tokens, dtype=np.int64)
        if counts.shape != id_array.shape or (counts < 1).any() or (counts >= 1 << 32).any():
            return None
        return ids, id_array, counts, counts.astype(np.uint32)
    except (TypeError, ValueError, OverflowError):
        return None
