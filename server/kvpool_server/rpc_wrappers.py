"""What makes a servicer method an RPC: admission through the servicer's Drain, and any raised error turned into
the call's status (``errors.abort``). ``rpc`` wraps a unary method; ``stream_rpc`` runs a per-message method over
a bidirectional stream. The undecorated method stays reachable as ``__wrapped__``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from kvpool_server.errors import abort

F = TypeVar("F", bound=Callable[..., Any])


def rpc(method: F) -> F:
    """A unary servicer method: refused with UNAVAILABLE while draining; any raised error ends the call with its
    status. ``self.drain`` is the servicer's Drain."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        drain = self.drain
        try:
            drain.admit()
            return method(self, request, context)
        except Exception as exc:
            abort(context, exc, method.__name__)
        finally:
            drain.release()

    return wrapper  # type: ignore[return-value]


def stream_rpc(method: F) -> F:
    """A bidirectional stream of ``method`` calls: each request answered by one response, in order.

    Each message is admitted like a unary call: counted in flight -- until its response has been sent -- and
    refused with UNAVAILABLE while draining. A stream waiting for the client's next message is not in flight, so
    an idle stream does not hold up shutdown. Once draining, the stream ends with UNAVAILABLE at the next message
    boundary (right after the response in progress is sent). A raised error ends the stream with its status: the
    messages before were applied, the failing one changed nothing, later ones are never read.
    """

    @functools.wraps(method)
    def wrapper(self: Any, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        drain = self.drain
        admitted = False  # a message is in flight: counted until its response is sent and the next one is due
        try:
            while True:
                if drain.draining:
                    drain.refuse()  # still counted: the status goes out before shutdown stops the server
                if admitted:
                    admitted = False
                    drain.release()
                try:
                    request = next(requests)
                except StopIteration:
                    return  # the client half-closed: every message was answered; OK
                except grpc.RpcError:
                    return  # cancelled by the client (or its deadline passed): nobody to answer
                admitted = True  # before admit, which counts and then may refuse
                drain.admit()
                yield method(self, request, context)  # resumed once gRPC has sent the response
        except Exception as exc:
            abort(context, exc, method.__name__)
        finally:
            if admitted:
                drain.release()

    return wrapper  # type: ignore[return-value]


def keep_alive_rpc(method: F) -> F:
    """A bidirectional stream whose messages share one state dict, with ``self.keep_alive_ended(state)`` run however
    the stream ends (half-close, cancellation, the client's connection lost, an error, the server draining): a
    KeepAlive stream's end may end its session. Messages are not admitted through the Drain: a heartbeat changes
    no sequence, and an idle keep-alive must not hold up shutdown."""

    @functools.wraps(method)
    def wrapper(self: Any, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        state: dict[str, Any] = {}
        try:
            for request in requests:
                yield method(self, state, request, context)
        except grpc.RpcError:
            return  # cancelled, or the client is gone
        except Exception as exc:
            abort(context, exc, method.__name__)
        finally:
            self.keep_alive_ended(state)

    return wrapper  # type: ignore[return-value]
