"""AppendStream: one AppendTokenStream call, ``step()`` by ``step()`` (arguments and results as convert.py builds
them for the unary AppendToken)."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import NoReturn

import grpc
import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client.convert import append_args, append_result
from kvpool_client.errors import KVPoolClientError, from_rpc_error
from kvpool_client.session import SessionState
from kvpool_client.types import AppendResult


class AppendStream:
    """One AppendTokenStream call: each ``step()`` sends one request and waits for its response.

    A step is applied exactly as a unary ``append()`` (atomically, copy-on-write copies done before its reply) and
    fails with the same exceptions. A failed step ends the stream: the steps before it were applied, the failing
    one changed nothing, and every later ``step()`` raises the same error. Shutting down, the server finishes the
    step in progress and then ends the stream with UNAVAILABLE (``UnavailableError``). Never retried: open a new
    stream. Steps from several threads are serialized. ``close()`` (or leaving a ``with`` block) half-closes the
    stream and waits for the server to end it; ``KVPoolClient.close()`` (the channel closing) cancels it.
    """

    _END = object()

    def __init__(
        self, open_call: Callable, timeout: float | None, session_id: int = 0, session: SessionState | None = None
    ) -> None:
        self._session_id = session_id
        self._session = session
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        # gRPC reads the request iterator from a thread of its own: each put() is sent as soon as it is queued, and
        # _END half-closes the stream and lets that thread go (also when the stream is dropped unclosed).
        self._responses = open_call(iter(self._requests.get, self._END), timeout=timeout)
        weakref.finalize(self, self._requests.put, self._END)
        self._lock = threading.Lock()
        self._error: KVPoolClientError | None = None
        self._closed = False

    def step(
        self, seq_ids: int | Sequence[int] | np.ndarray, num_tokens: int | Sequence[int] | np.ndarray = 1
    ) -> AppendResult:
        """Grow every sequence of ``seq_ids`` by ``num_tokens`` (one count for all, or one each), atomically."""
        ids, counts, counts_field = append_args(seq_ids, num_tokens, _STREAM)
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise KVPoolClientError("the stream is closed", method=_STREAM)
            request_id = self._session.next_request_id() if self._session is not None and self._session_id else 0
            self._requests.put(pb.AppendTokenStreamRequest(seq_ids=ids, num_tokens=counts_field,
                                                           session_id=self._session_id, request_id=request_id))
            try:
                response = next(self._responses)
            except grpc.RpcError as error:
                self._fail(from_rpc_error(error, _STREAM))
            except StopIteration:  # the server ended the stream without answering: not kvpool's protocol
                self._fail(KVPoolClientError("the server ended the stream without a response", method=_STREAM))
        return append_result(ids, counts, response)

    def _fail(self, error: KVPoolClientError) -> NoReturn:
        self._error, self._closed = error, True
        self._requests.put(self._END)
        raise error from None

    def close(self) -> None:
        """Half-close the stream and wait for the server to end it (it has answered every step by then)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._requests.put(self._END)
            try:
                for _ in self._responses:
                    pass
            except grpc.RpcError:
                pass  # failed earlier (already raised by step) or ended by a shutdown: no step is left unanswered

    def __enter__(self) -> AppendStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_STREAM = "AppendTokenStream"
