"""A large request's one bulk ``bytes`` field (WriteKV's ``data``) taken as a view of the received bytes, not copied.

Parsing a 64 MiB WriteKVRequest with protobuf copies ``data`` into the message, and reading ``request.data`` copies
it again into a Python ``bytes``: with the received body that is three times the payload, for as long as the copy
runs. ``split_bulk`` walks the top-level fields of the body instead (a handful: ``MAX_FIELDS`` at most), returns
the bulk field's last occurrence (proto3: the last one wins) as a ``memoryview`` of the body, and the other fields'
bytes -- small -- which protobuf parses and checks as usual. ``BulkRequest`` is the parsed message with the bulk
field read from the view. Anything unusual (groups, a truncated field, many fields, big other fields) returns None
and the caller parses the whole body with protobuf, which checks it (and refuses a malformed one).
"""

from __future__ import annotations

from typing import Any

MAX_FIELDS = 64  # more top-level fields than this: not a plain bulk request, parse it the ordinary way
MAX_REST_BYTES = 64 << 10  # the other fields' bytes at most (they are parsed on the event loop)


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it); (-1, pos) when it is truncated or longer than 10 bytes."""
    value = shift = 0
    while pos < end and shift < 70:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return -1, pos


def split_bulk(body: bytes, field_number: int) -> tuple[bytes, memoryview] | None:
    """(the other fields' bytes, a view of field ``field_number``'s value), or None to parse ``body`` whole."""
    view = memoryview(body)
    end = len(body)
    pos = kept_from = 0
    rest: list[memoryview] = []
    bulk = view[0:0]
    for _ in range(MAX_FIELDS):
        if pos >= end:
            rest.append(view[kept_from:end])
            joined = b"".join(rest)
            return (joined, bulk) if len(joined) <= MAX_REST_BYTES else None
        key, after = _varint(body, pos, end)
        wire_type = key & 7
        if key < 0:
            return None
        if wire_type == 0:
            value, after = _varint(body, after, end)
            if value < 0:
                return None
        elif wire_type == 1:
            after += 8
        elif wire_type == 5:
            after += 4
        elif wire_type == 2:
            length, start = _varint(body, after, end)
            if length < 0:
                return None
            after = start + length
            if key >> 3 == field_number and after <= end:
                rest.append(view[kept_from:pos])
                bulk = view[start:after]
                kept_from = after
        else:
            return None  # groups: protobuf's to handle
        if after > end:
            return None
        pos = after
    return None


class BulkRequest:
    """A parsed message whose bulk field (``name``) is read from a view of the received body."""

    __slots__ = ("_message", "_name", "_bulk")

    def __init__(self, message: Any, name: str, bulk: memoryview) -> None:
        self._message = message
        self._name = name
        self._bulk = bulk

    def __getattr__(self, attr: str) -> Any:
        return self._bulk if attr == self._name else getattr(self._message, attr)
