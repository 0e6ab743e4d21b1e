"""The largest body a valid request of a method can have, from the server's limits: a body over it is refused by
its length alone, on arrival, before any parsing.

Parsing a 66 M-token RegisterSequence into Python took ~2 s (a copy thread holds the GIL meanwhile: Health waited
that long) only for the service to refuse it on its first check (``prompt_token_ids`` over ``--max-seq-len``). A
request's size follows from its fields: each repeated field holds at most its limit's count (``field_limits``),
each value is at most 10 bytes (a varint) plus its 1-2 byte key (packed or not), a bytes/string field at most its
limit's length. So ``max_request_bytes(RegisterSequenceRequest, limits)`` is ~400 KB with the default 32,768-token
``--max-seq-len``; a 63 MiB body is answered INVALID_ARGUMENT in O(1), nothing parsed, nothing charged.

A message with a field of no known limit (WriteKV's ``data``, a page token) has no bound here (None): its body is
bounded by ``--max-message-bytes`` and, when large, by the byte budget (``service/byte_budget.py``). Every bound
leaves ``UNKNOWN_FIELDS_BYTES`` for fields a newer client may send (ignored by this server, as proto3 wants).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from kvpool_server.core import InvalidArgumentError
from kvpool_server.core.block_hash import MAX_EXTRA_KEY_BYTES
from kvpool_server.service.paging import MAX_CLIENT_NAME_BYTES

UNKNOWN_FIELDS_BYTES = 64 << 10
MAX_VARINT_BYTES = 10
_FIXED_BYTES = {FieldDescriptor.TYPE_FIXED32: 4, FieldDescriptor.TYPE_SFIXED32: 4, FieldDescriptor.TYPE_FLOAT: 4,
                FieldDescriptor.TYPE_FIXED64: 8, FieldDescriptor.TYPE_SFIXED64: 8, FieldDescriptor.TYPE_DOUBLE: 8}


class Limit(NamedTuple):
    """A field's most elements (repeated) or bytes (bytes/string), and the setting that says so."""

    most: int
    setting: str


class Bound(NamedTuple):
    num_bytes: int
    why: str  # the limits it follows from, for the refusal's message


def field_limits(*, max_seq_len: int, max_batch: int, max_tokens_per_call: int) -> dict[str, Limit]:
    """The limits the service checks, by field name (the same name means the same thing in every request)."""
    return {
        "prompt_token_ids": Limit(max_seq_len, "--max-seq-len"),
        "token_ids": Limit(max_tokens_per_call, "--max-tokens-per-call"),
        "seq_ids": Limit(max_batch, "--max-batch"),
        "num_tokens": Limit(max_batch, "--max-batch"),
        "child_seq_ids": Limit(max_batch, "--max-batch"),
        "cache_extra_key": Limit(MAX_EXTRA_KEY_BYTES, f"{MAX_EXTRA_KEY_BYTES} bytes"),
        "client_name": Limit(MAX_CLIENT_NAME_BYTES, f"{MAX_CLIENT_NAME_BYTES} bytes"),
    }


def _key_bytes(field: FieldDescriptor) -> int:
    return max(1, ((field.number << 3).bit_length() + 6) // 7)


def _value_bytes(field: FieldDescriptor, limits: Mapping[str, Limit]) -> int | None:
    if field.type in _FIXED_BYTES:
        return _FIXED_BYTES[field.type]
    if field.type in (FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_STRING):
        limit = limits.get(field.name)
        return None if limit is None else MAX_VARINT_BYTES + limit.most
    if field.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
        return None
    return MAX_VARINT_BYTES  # every varint type (ints, bools, enums)


def max_request_bytes(descriptor: Descriptor, limits: Mapping[str, Limit]) -> Bound | None:
    """The most bytes a valid ``descriptor`` message can take, or None when a field has no known limit."""
    total, why = UNKNOWN_FIELDS_BYTES, []
    for field in descriptor.fields:
        value = _value_bytes(field, limits)
        if value is None:
            return None
        key = _key_bytes(field)
        if field.is_repeated:
            limit = limits.get(field.name)
            if limit is None:
                return None
            total += key + MAX_VARINT_BYTES + limit.most * (key + value)  # packed or not, at most this
            why.append(f"{field.name} at most {limit.most:,} ({limit.setting})")
        else:
            total += key + value
            if field.name in limits:
                why.append(f"{field.name} at most {limits[field.name].setting}")
    return Bound(total, ", ".join(why))


def check_size(bound: Bound | None, num_bytes: int, rpc: str) -> None:
    """Raise InvalidArgumentError when a body of ``num_bytes`` is over ``bound``."""
    if bound is not None and num_bytes > bound.num_bytes:
        raise InvalidArgumentError(f"{rpc}: the request is {num_bytes:,} bytes, more than any valid one ({bound.num_bytes:,} bytes "
                    f"at most: {bound.why or 'small fields only'}); refused unread")
