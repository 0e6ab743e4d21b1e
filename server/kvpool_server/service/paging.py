"""Pages of ListSessions / ListSequences: how many rows one reply carries, and the opaque token that goes on.

A listing is ordered by id (session_id, seq_id: both only grow within a server start), and a page token is the
last id of the previous page, encoded with what it lists ("sessions", or "sequences" of one session), so a token
of another listing is refused (INVALID_ARGUMENT) instead of being read wrongly. A row that appears or ends between
two pages is listed, or not, depending on which side of the token its id lies: no row is listed twice.

How many rows a page holds: the request's ``page_size`` (0: ``DEFAULT_PAGE_SIZE``), at most ``MAX_PAGE_SIZE`` and
at most what fits ``--max-message-bytes`` at the row's worst-case size, so a reply is bounded in bytes whatever
lives on the server.
"""

from __future__ import annotations

import base64
import binascii

from kvpool_server.core import InvalidArgumentError

DEFAULT_PAGE_SIZE = 1000
MAX_PAGE_SIZE = 10_000
MAX_CLIENT_NAME_BYTES = 256  # OpenSession's client_name, UTF-8 (longer: INVALID_ARGUMENT)
# Worst-case encoded size of one row: the largest value of every field, its tag, and the row's own framing.
SESSION_ROW_BYTES = 3 + (1 + 10) + (2 + MAX_CLIENT_NAME_BYTES + 1) + (1 + 10) + 2 * (1 + 5) + 2 + 2 * (1 + 5)
SEQUENCE_ROW_BYTES = 2 + 2 * (1 + 10) + 2 * (1 + 5)
ENVELOPE_BYTES = 1024  # the reply's other fields and the token


def page_size(requested: int, row_bytes: int, max_message_bytes: int) -> int:
    """Rows in one page: ``requested`` (0: the default), capped by ``MAX_PAGE_SIZE`` and by the message limit."""
    fits = max(1, (max_message_bytes - ENVELOPE_BYTES) // row_bytes)
    return max(1, min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, fits))


def encode_token(listing: str, last_id: int) -> str:
    return base64.urlsafe_b64encode(f"{listing}:{last_id}".encode()).decode().rstrip("=")


def decode_token(token: str, listing: str) -> int:
    """The last id a page token names (-1 for no token: from the first row); INVALID_ARGUMENT for a token that is
    not one of this listing's."""
    if not token:
        return -1
    try:
        text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        kind, _, last = text.rpartition(":")
        if kind == listing and last.isdigit():
            return int(last)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise InvalidArgumentError(
        f"page_token {token[:64]!r} is not a next_page_token of this listing ({listing}); start without one"
    )


def check_client_name(client_name: str) -> None:
    size = len(client_name.encode("utf-8", "surrogatepass"))
    if size > MAX_CLIENT_NAME_BYTES:
        raise InvalidArgumentError(
            f"client_name is {size} bytes; at most {MAX_CLIENT_NAME_BYTES} bytes of UTF-8 (e.g. host:pid)"
        )
