"""gRPC C-core's log lines through kvpool's logging: one log format (``--log-format json`` included).

gRPC's core writes its own lines straight to file descriptor 2, in absl's format::

    E1201 12:03:44.123456   27858 add_port.cc:83] Failed to add port to server: ...

``CoreLogCapture.start()`` puts a pipe on fd 2 and keeps the real stderr for Python (``sys.stderr`` and every
logging handler made after it write there). A reader thread turns each core line into a record of the logger
``grpc.core`` (E -> ERROR, W -> WARNING, I -> INFO, F -> CRITICAL; the message is ``file:line] text``), so it comes out
as text or JSON like every other line; a line that is not absl's (a C extension's print, a fatal error dump) is
passed through as it came. Lines that kvpool says better itself are dropped (``SAID_BETTER``: the failed bind, which
kvpool reports with the port's owner and the fix). ``stop()`` puts the real stderr back and drains the pipe.

Bounded: a line is cut at ``MAX_LINE_BYTES``; the pipe's write end is non-blocking, so a core thread never waits on
the reader -- a line written while the pipe (64 KiB) is full is lost, not queued; and each core source line
(``file:line``) is logged at most once per 10 s with the count of those held back (log_limits.RateLimitedLog), so
a flood of failed TLS handshakes costs one line per interval.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import sys
import threading
from typing import TextIO

from kvpool_server.log_limits import RateLimitedLog

MAX_LINE_BYTES = 8192
END = b"\x00kvpool-core-log-end\n"  # written by stop() after everything else: the reader's last line
CORE_LINE = re.compile(r"^([EWIF])\d{4} [\d:.]+\s+\d+ (\S+:\d+)\] ?(.*)$")
LEVELS = {"E": logging.ERROR, "W": logging.WARNING, "I": logging.INFO, "F": logging.CRITICAL}
# (source file, text) of core lines kvpool reports better itself: dropped.
SAID_BETTER = (("add_port.cc", "Failed to add port"),)

logger = logging.getLogger("grpc.core")


class CoreLogCapture:
    """fd 2 through a pipe whose lines become ``grpc.core`` log records (module docstring)."""

    def __init__(self) -> None:
        self._saved_fd: int | None = None
        self._read_fd: int | None = None
        self._end_fd: int | None = None  # a write end of our own: stop() ends the reader through it
        self._thread: threading.Thread | None = None
        self._real_stderr: TextIO | None = None
        self._limited = RateLimitedLog(logger)

    def start(self) -> None:
        """Before logging is configured (its handlers take ``sys.stderr`` as it is then)."""
        sys.stderr.flush()
        self._saved_fd = os.dup(2)
        self._real_stderr = os.fdopen(os.dup(self._saved_fd), "w", buffering=1, errors="backslashreplace")
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # a full pipe loses a core line; it never blocks a gRPC thread
        os.dup2(write_fd, 2)
        self._end_fd = write_fd
        self._read_fd = read_fd
        sys.stderr = self._real_stderr
        faulthandler.enable(self._real_stderr)  # a crash's traceback goes to the real stderr, not the pipe
        self._thread = threading.Thread(target=self._read, name="grpc-core-log", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """The real stderr back on fd 2; the lines still in the pipe logged. The reader ends at the END line written
        after them (not at EOF: a child process may hold a copy of the old fd 2)."""
        if self._saved_fd is None or self._end_fd is None:
            return
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        self._saved_fd = None
        os.set_blocking(self._end_fd, True)
        os.write(self._end_fd, END)
        os.close(self._end_fd)
        self._end_fd = None
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _read(self) -> None:
        assert self._read_fd is not None
        pending = b""
        with os.fdopen(self._read_fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if len(pending) > MAX_LINE_BYTES:
                    lines.append(pending)
                    pending = b""
                for line in lines:
                    if line + b"\n" == END:
                        return
                    self.emit(line[:MAX_LINE_BYTES].decode("utf-8", "backslashreplace"))
        if pending:
            self.emit(pending[:MAX_LINE_BYTES].decode("utf-8", "backslashreplace"))

    def emit(self, line: str) -> None:
        """One line written to fd 2: a ``grpc.core`` record, dropped, or passed through."""
        match = CORE_LINE.match(line)
        if match is None:
            if line and self._real_stderr is not None:
                self._real_stderr.write(line + "\n")
            return
        level, source, text = match.groups()
        if any(source.startswith(f"{name}:") and text.startswith(said) for name, said in SAID_BETTER):
            return
        self._limited.log(LEVELS[level], source, "%s] %s", source, text)
