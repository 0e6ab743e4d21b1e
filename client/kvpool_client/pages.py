"""Following the pages of ListSessions / ListSequences: ask again with ``page_token`` = the reply's
``next_page_token`` until it is empty (the server lists by id, at most 1000 rows a page by default)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def all_pages(call: Callable[[str, Any], Any], rpc: str, request: Any, field: str) -> tuple[list[Any], Any]:
    """Every row of a paged listing -- ``call(rpc, request)`` page after page -- and the last reply (for its other
    fields, e.g. ``server_epoch``). ``request`` is changed (its ``page_token``)."""
    rows: list[Any] = []
    seen: set[str] = set()
    while True:
        reply = call(rpc, request)
        rows.extend(getattr(reply, field))
        token = reply.next_page_token
        if not token or token in seen:  # a server that repeated a token would loop forever
            return rows, reply
        seen.add(token)
        request.page_token = token
