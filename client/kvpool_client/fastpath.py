"""The client's end of a fast-path channel (docs/fast-path.md): write a request record, publish it, wait for the
reply record -- spinning SPIN_S, then parked on the channel's unix socket.

    channel = FastChannel.connect(open_fast_path_response)     # map the segment, connect, send the token
    result = channel.append(ids, counts, token_ids, request_id, "AppendToken", timeout)

A reply with a status raises the exception of errors.py that gRPC's status would (same code, same
``kvpool-error`` reason); a fenced channel raises SessionLostError (its session ended) or UnavailableError (the
server is stopping); the socket closing without a fence (the server died) raises ServerGoneError at once. One
request at a time per channel (``lock``).
"""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import Any

import grpc
import numpy as np

from kvpool import fastpath as fp
from kvpool_client.errors import (
    ERROR_FOR_CODE,
    REASONS,
    DeadlineExceededError,
    KVPoolClientError,
    ServerGoneError,
    SessionLostError,
    UnavailableError,
    UnknownError,
)
from kvpool_client.types import AppendResult

SPIN_S = 200e-6  # the reply usually comes within this (the server's work); after it, park on the socket
PARK_SLICE_S = 0.05  # a parked wait looks again this often (a wake lost to store/load reordering costs this)
CONNECT_TIMEOUT_S = 2.0
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
_barrier = threading.Lock()


def memory_barrier() -> None:
    """A full barrier between our store and our load of the other side's flag (see the server's)."""
    _barrier.acquire()
    _barrier.release()


def is_local_target(target: str) -> bool:
    """A unix socket or a loopback address: the server's shared memory is this host's."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.split("://", 1)[-1]
    host = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:host.find("]")]
    return host in ("localhost", "::1") or host.startswith("127.")


def error_for(code: int, message: str, reason: int, method: str) -> KVPoolClientError:
    """The exception gRPC's status would have raised (errors.from_rpc_error's table)."""
    status = STATUS_CODES.get(code, grpc.StatusCode.UNKNOWN)
    cls = ERROR_FOR_CODE.get(status, UnknownError)
    if status in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED) and 0 < reason < len(fp.REASONS):
        cls = REASONS.get(fp.REASONS[reason], cls)
    return cls(message, code=status, method=method)


class FastChannel:
    def __init__(self, mapping: Any, sock: socket.socket, response: Any) -> None:
        self.mapping = mapping
        self.sock = sock
        self.area_bytes = int(response.area_bytes)
        self.generation = int(response.generation)
        self.max_batch = int(response.max_batch)
        self.views: fp.Views | None = fp.Views(mapping, self.area_bytes)
        self.seq = 0
        self.lock = threading.Lock()
        self.broken: KVPoolClientError | None = None  # set once the channel cannot be used again

    @classmethod
    def connect(cls, response: Any) -> FastChannel:
        """Map the segment and bind the connection with the token; OSError/ValueError when that fails."""
        mapping = fp.open_segment(response.shm_name, int(response.segment_bytes))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            address = response.socket_address
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect("\0" + address[1:] if address.startswith("@") else address)
            sock.sendall(response.token)
            if sock.recv(1) != b"k":
                raise OSError("the server refused the fast-path connection")
            sock.setblocking(False)
            channel = cls(mapping, sock, response)
            ctl = channel.views.ctl if channel.views is not None else None
            if ctl is None or ctl[fp.CTL_MAGIC] != fp.MAGIC or ctl[fp.CTL_GENERATION] != channel.generation:
                raise OSError("the fast-path segment is not the one the server described")
            return channel
        except BaseException:
            sock.close()
            mapping.close()
            raise

    def close(self) -> None:
        with self.lock:
            self.broken = self.broken or UnavailableError("the fast-path channel is closed")
            if self.views is not None:
                self.views.release()
                self.views = None
            self.sock.close()
            try:
                self.mapping.close()
            except BufferError:
                pass

    # ---------------------------------------------------------------- the calls
    def fits(self, n_ids: int, n_counts: int, n_tokens: int, extra: int = 0, reply: int = 0) -> bool:
        return fp.request_bytes(n_ids, n_counts, n_tokens, extra) <= self.area_bytes and reply <= self.area_bytes

    def append(self, ids: tuple[int, ...], id_array: np.ndarray, counts: np.ndarray, counts_field: np.ndarray,
               tokens: np.ndarray | None, request_id: int, method: str, timeout: float) -> AppendResult:
        def write(views: fp.Views) -> None:
            _request(views, fp.OP_APPEND, request_id, self.generation, ids=id_array, counts=counts_field,
                     tokens=tokens)

        with self.lock:
            views = self._exchange(write, method, timeout)
            rep, area = views.rep, views.rep_area
            n_slots, n_new, n_copies = int(rep[fp.REP_N_SLOTS]), int(rep[fp.REP_N_NEW]), int(rep[fp.REP_N_COPIES])
            at = fp.HEADER_BYTES
            slots = area[at:at + 8 * n_slots].view(np.int64).copy()
            at += 8 * n_slots
            new = area[at:at + 4 * n_new].view(np.int32).astype(np.int64)
            at += fp.align8(4 * n_new)
            copies = area[at:at + 8 * n_copies].view(np.int32).astype(np.int64).reshape(-1, 2)
        return AppendResult(seq_ids=ids, num_tokens=counts, slot_mapping=slots, new_block_ids=new,
                            copies=copies)

    def register(self, seq_id: int | None, prompt: Any, public_prefix_len: int, cache_extra_key: bytes,
                 request_id: int, method: str, timeout: float) -> tuple[int, int]:
        tokens = np.asarray(prompt, dtype=np.uint32) if prompt is not None else None

        def write(views: fp.Views) -> None:
            _request(views, fp.OP_REGISTER, request_id, self.generation, tokens=tokens, extra=cache_extra_key,
                     arg0=seq_id or 0, arg1=public_prefix_len)

        with self.lock:
            views = self._exchange(write, method, timeout)
            rep = views.rep
            return int(rep[fp.REP_VALUE0]) & ((1 << 64) - 1), int(rep[fp.REP_VALUE1])

    def fork(self, parent: int, num_children: int, children: list[int], request_id: int, method: str,
             timeout: float) -> list[int]:
        def write(views: fp.Views) -> None:
            _request(views, fp.OP_FORK, request_id, self.generation, ids=np.asarray(children, dtype=np.uint64),
                     arg0=parent, arg1=num_children)

        with self.lock:
            views = self._exchange(write, method, timeout)
            n = int(views.rep[fp.REP_N_CHILDREN])
            return views.rep_area[fp.HEADER_BYTES:fp.HEADER_BYTES + 8 * n].view(np.uint64).tolist()

    def free(self, ids: list[int], request_id: int, method: str, timeout: float) -> int:
        def write(views: fp.Views) -> None:
            _request(views, fp.OP_FREE, request_id, self.generation, ids=np.asarray(ids, dtype=np.uint64))

        with self.lock:
            return int(self._exchange(write, method, timeout).rep[fp.REP_VALUE0])

    # ---------------------------------------------------------------- one exchange
    def _exchange(self, write: Any, method: str, timeout: float) -> fp.Views:
        """Write, publish, wait; the views with an OK reply in them (hold ``lock``), or raise its exception."""
        views = self._usable(method)
        seq = self.seq + 1
        write(views)
        views.req[fp.REQ_SEQ] = seq
        ctl = views.ctl
        ctl[fp.CTL_REQ_SEQ] = seq
        self.seq = seq
        memory_barrier()
        if ctl[fp.CTL_SERVER_PARKED]:
            self._send_wake(method)
        self._wait(views, seq, method, timeout)
        rep = views.rep
        code = int(rep[fp.REP_CODE])
        if code:
            n = min(max(int(rep[fp.REP_MSG_LEN]), 0), fp.MAX_MESSAGE_BYTES)
            message = views.rep_area[fp.HEADER_BYTES:fp.HEADER_BYTES + n].tobytes().decode("utf-8", "replace")
            raise error_for(code, message, int(rep[fp.REP_REASON]), method)
        return views

    def _usable(self, method: str) -> fp.Views:
        if self.broken is not None or self.views is None:
            error = self.broken or UnavailableError("the fast-path channel is closed")
            raise type(error)(error.details, code=error.code, method=method)
        fenced = int(self.views.ctl[fp.CTL_FENCED])
        if fenced:
            self._break(self._fence_error(fenced), method)
        return self.views

    def _fence_error(self, fenced: int) -> KVPoolClientError:
        if fenced == fp.FENCED_SESSION_ENDED:
            return SessionLostError("the session of this fast-path channel ended (lease expired, or closed)")
        if fenced == fp.FENCED_SERVER_STOPPING:
            return UnavailableError("kvpool-server is shutting down: the fast-path channel is closed")
        return UnavailableError("the server closed this fast-path channel (a request broke the record protocol)")

    def _break(self, error: KVPoolClientError, method: str) -> None:
        self.broken = error
        raise type(error)(error.details, code=error.code, method=method)

    def _send_wake(self, method: str) -> None:
        try:
            self.sock.send(b"w", socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass  # the server has wakes it has not read yet: it is awake
        except OSError:
            self._break(ServerGoneError("the fast-path socket is closed: the server is gone"), method)

    def _wait(self, views: fp.Views, seq: int, method: str, timeout: float) -> None:
        ctl = views.ctl
        perf = time.perf_counter
        spin_end = perf() + SPIN_S
        while ctl[fp.CTL_REP_SEQ] != seq:
            if perf() > spin_end:
                break
        else:
            return
        deadline = time.monotonic() + timeout
        ctl[fp.CTL_CLIENT_PARKED] = 1
        memory_barrier()
        try:
            while ctl[fp.CTL_REP_SEQ] != seq:
                fenced = int(ctl[fp.CTL_FENCED])
                if fenced:
                    self._break(self._fence_error(fenced), method)
                remaining = deadline - time.monotonic()
                if remaining <= 0:  # the request may still be applied: the channel is out of step, give it up
                    self._break(DeadlineExceededError(
                        f"no fast-path reply within {timeout:g} s", code=grpc.StatusCode.DEADLINE_EXCEEDED), method)
                ready, _, _ = select.select([self.sock], [], [], min(remaining, PARK_SLICE_S))
                if ready:
                    try:
                        data = self.sock.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data and ctl[fp.CTL_REP_SEQ] != seq:
                        fenced = int(ctl[fp.CTL_FENCED])
                        self._break(self._fence_error(fenced) if fenced else ServerGoneError(
                            "the server closed the fast-path socket without an answer: it is gone"), method)
        finally:
            ctl[fp.CTL_CLIENT_PARKED] = 0


def _request(views: fp.Views, op: int, request_id: int, generation: int, *, ids: Any = None, counts: Any = None,
             tokens: Any = None, extra: bytes = b"", arg0: int = 0, arg1: int = 0) -> None:
    """Write a request record's arrays and header (not yet published)."""
    area, req = views.req_area, views.req
    n_ids = 0 if ids is None else ids.size
    n_counts = 0 if counts is None else counts.size
    n_tokens = 0 if tokens is None else tokens.size
    at = fp.HEADER_BYTES
    if n_ids:
        area[at:at + 8 * n_ids].view(np.uint64)[:] = ids
    at += 8 * n_ids
    if n_counts:
        area[at:at + 4 * n_counts].view(np.uint32)[:] = counts
    at += fp.align8(4 * n_counts)
    if n_tokens:
        area[at:at + 4 * n_tokens].view(np.uint32)[:] = tokens
    at += fp.align8(4 * n_tokens)
    if extra:
        area[at:at + len(extra)] = np.frombuffer(extra, np.uint8)
    wrap = 1 << 64  # uint64 fields as the int64 words with the same bits
    req[:fp.REQ_SEQ] = (op, request_id - wrap if request_id >= 1 << 63 else request_id, generation, n_ids, n_counts,
                        n_tokens, arg0 - wrap if arg0 >= 1 << 63 else arg0, arg1, len(extra))
