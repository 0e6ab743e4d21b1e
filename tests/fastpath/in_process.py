"""A kvpool server inside the test's process (host backend), for tests that patch the server's code: a reply whose
write fails, a server of before a record (``refusing_op``), the channel registry's invariants.

    with in_process_server(num_blocks=2048) as handle:      handle.port, handle.service, handle.fast_path
        ...
    refusing_op(monkeypatch, fp.OP_STEP)                     the fast path answers that op "unknown op", unapplied
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def in_process_server(num_blocks: int = 256, head_dim: int = 8, *flags: str) -> Iterator[Any]:
    """A started server on a free TCP port of 127.0.0.1, stopped on exit."""
    from kvpool_server.config import load_config
    from kvpool_server.grpc_api.server import build_server

    handle = build_server(load_config(["--backend", "host", "--num-blocks", str(num_blocks), "--head-dim",
                                       str(head_dim), "--address", "127.0.0.1:0", *flags]))
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


def refusing_op(monkeypatch: Any, op: int) -> None:
    """Make the fast path refuse ``op`` as a server of before it does: INVALID_ARGUMENT "unknown op", nothing
    applied (every other op served as before)."""
    from kvpool_server.core import InvalidArgumentError
    from kvpool_server.fastpath import records

    real = records._invocation

    def old_server(service, call, views, header, record_op, *args):
        if record_op == op:
            raise InvalidArgumentError(f"fast path: unknown op {record_op}")
        return real(service, call, views, header, record_op, *args)

    monkeypatch.setattr(records, "_invocation", old_server)
