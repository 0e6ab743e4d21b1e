"""The kvpool variant's control path: a ``KVPoolClient`` whose appends go on one ``AppendTokenStream``, the client's
fastest path for a decode loop (2.6x the unary rate, docs/results.md); every other call is the client's own."""

from __future__ import annotations

from typing import Any


class StreamedAppends:
    """A ``KVPoolClient`` whose appends go on one ``AppendTokenStream`` (2.6x the unary rate, docs/results.md)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.stream = client.append_stream()

    def append(self, seq_ids: Any, num_tokens: Any = 1) -> Any:
        return self.stream.step(seq_ids, num_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def control_path(client: Any, append_stream: bool | None) -> Any:
    """An engine's control path over ``client``: the client itself when its fast path is on (``append_stream=None``,
    the server on this host) or when ``append_stream=False``; else appends on one ``AppendTokenStream``."""
    if append_stream is None:
        append_stream = not getattr(client, "fast_path_enabled", False)
    return StreamedAppends(client) if append_stream else client
