"""Channel: one session's shared-memory segment and the unix socket that wakes its two sides.

Invariant: a channel's segment is reserved whole (``shm_segments.create_segment``; no room: SharedMemoryFullError,
RESOURCE_EXHAUSTED, and no channel) and stays mapped (``views`` not None) until ``close()``; only the fast-path thread
touches a live channel (``FastPathServer.stop`` closes them after that thread has ended). Every request it serves
names its own ``session_id``, so a channel whose session has ended is refused by the session table
(``CoreGuard.mutate``) even before the thread fences and closes it.
"""

from __future__ import annotations

import mmap
import socket

from kvpool import fastpath as fp
from kvpool.fastpath_codec import memory_barrier as memory_barrier  # the codec's, re-exported for the thread
from kvpool_server.service.auth import Identity
from kvpool_server.service.errors import SharedMemoryFullError
from kvpool_server.service.reply_limits import RECEIVE_LIMIT_KEY
from kvpool_server.shm_segments import CHANNEL_KIND, ShmFullError, create_segment, segment_name, unlink_segment


class ChannelHeaders:
    """A record's headers: the channel's authorization (checked again at every record: a token revoked by SIGHUP
    is refused at the next one) and no gRPC reply limit (records.py checks the reply area's bound); one per
    channel, made once."""

    __slots__ = ("authorization",)

    def __init__(self, authorization: str | None) -> None:
        self.authorization = authorization

    def get(self, key: str) -> str | None:
        if key == "authorization":
            return self.authorization
        if key == RECEIVE_LIMIT_KEY:
            return "-1"
        return None


class Channel:
    def __init__(self, name: str, area_bytes: int, session_id: int, caller: Identity, authorization: str | None,
                 generation: int, token: bytes) -> None:
        self.name = name
        self.session_id = session_id
        self.area_bytes = area_bytes
        self.tenant = caller.tenant_id
        self.authorization = authorization  # the header OpenFastPath carried: every record is authenticated again
        self.headers = ChannelHeaders(authorization)  # what each record's call scope reads it from
        self.generation = generation
        self.token = token
        try:  # every page reserved: a client's or our first touch of one is never SIGBUS
            self.mapping: mmap.mmap | None = create_segment(name, fp.segment_bytes(area_bytes),
                                                            what="a fast-path channel")
        except ShmFullError as exc:
            raise SharedMemoryFullError(f"{exc.strerror}: no fast-path channel, use gRPC") from None
        self.views: fp.Views | None = fp.Views(self.mapping, area_bytes)
        ctl = self.views.ctl
        ctl[fp.CTL_GENERATION] = generation
        ctl[fp.CTL_AREA_BYTES] = area_bytes
        ctl[fp.CTL_MAGIC] = fp.MAGIC
        self.linked = True  # the segment's name exists (until the client has connected)
        self.sock: socket.socket | None = None
        self.last_seq = 0  # the last request seq served (the server's own count, never read back from the segment)
        self.fenced = 0  # a FENCED_* reason once the channel must serve nothing more
        self.opened_at = 0.0
        # (seq, records.Deferred, its concurrent future): a record settling on the event loop, answered once done
        self.deferred: tuple | None = None

    def connected(self, sock: socket.socket) -> None:
        self.sock = sock
        self.unlink()

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            unlink_segment(self.name)

    def fence(self, reason: int) -> None:
        """Mark the channel closed in the segment (the client sees it at its next request); serve nothing more."""
        if not self.fenced:
            self.fenced = reason
            if self.views is not None:
                self.views.ctl[fp.CTL_FENCED] = reason

    def wake_client(self) -> None:
        """A byte on the socket, only when the client has parked (it spins first)."""
        if self.sock is not None and self.views is not None and self.views.ctl_words[fp.CTL_CLIENT_PARKED]:
            try:
                self.sock.send(b"w", socket.MSG_DONTWAIT)
            except OSError:
                pass  # its buffer is full of wakes it has not read (it will see the reply), or it is gone

    def close(self) -> None:
        """Fence, wake a parked client (it sees the fence), close the socket, unmap (fast-path thread only)."""
        self.fence(fp.FENCED_SERVER_STOPPING)
        self.wake_client()
        self.unlink()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.views is not None:
            self.views.release()
            self.views = None
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a view still exported somewhere: the mapping goes with its last reference
                pass
            self.mapping = None

    def fileno(self) -> int:
        return self.sock.fileno() if self.sock is not None else -1


def new_name() -> str:
    """``kvpool-fp-<pid>-<start time>-<pid namespace>-<random>``: the start-up sweep reaps it if we die."""
    return segment_name(CHANNEL_KIND)
