"""How big a reply may be, and how big a mutation's reply can get -- known *before* the core changes anything.

gRPC serializes a response after the handler returns, so a reply over the send limit (the server's
``--max-message-bytes``) or over the client's receive limit fails *after* the mutation was applied. So a mutating
call whose reply could exceed ``reply_limit`` is refused up front (INVALID_ARGUMENT, nothing changed):

    reply_limit = min(--max-message-bytes, what the client declares)
    the client declares its receive limit in the metadata key ``kvpool-max-receive-bytes`` (the kvpool client
    library does); absent: 4 MiB, the default receive limit of most gRPC stacks. A declaration below 64 KiB counts
    as 64 KiB (no real stack is that small, and it lets the common small reply skip the metadata).

The bound of an AppendToken reply is exact in the worst case, from the request alone: each of the T new tokens'
slots is a varint of at most ``varint_len(num_slots - 1)`` bytes, at most ``T // block_size + len(seq_ids)`` new
block ids (and never more than the pool) of ``varint_len(num_blocks - 1)`` bytes, at most one copy-on-write copy
per sequence.
Also refused: an append of more than ``--max-tokens-per-call`` tokens, so that no append holds the pool long.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvpool_server.core import InvalidArgumentError

if TYPE_CHECKING:
    from kvpool_server.service.scope import Headers

RECEIVE_LIMIT_KEY = "kvpool-max-receive-bytes"
DEFAULT_CLIENT_RECEIVE_BYTES = 4 << 20
MIN_DECLARED_BYTES = 64 << 10
_FIELD_OVERHEAD = 1 + 5  # a field's tag and a packed field's length prefix


def varint_len(value: int) -> int:
    return max(1, (int(value).bit_length() + 6) // 7)


def declared_receive_limit(text: str | None) -> int | None:
    """The client's ``kvpool-max-receive-bytes`` (None when absent or not a positive integer; -1 is unlimited)."""
    if text is None:
        return None
    if text.strip() == "-1":
        return 1 << 62
    return int(text) if text.strip().isdigit() and int(text) > 0 else None


class ReplyLimits:
    """The bounds of one server (its message limit and its pool's geometry)."""

    def __init__(self, max_message_bytes: int, num_blocks: int, block_size: int, *, max_seq_len: int,
                 max_tokens_per_call: int) -> None:
        self.max_message_bytes = max_message_bytes
        self.max_seq_len = max_seq_len
        self.max_tokens_per_call = max_tokens_per_call
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.slot_bytes = varint_len(num_blocks * block_size - 1)
        self.block_bytes = varint_len(num_blocks - 1)
        self.copy_bytes = 2 + 2 * (1 + self.block_bytes)  # BlockCopy{src, dst} with its tag and length
        self.always_fits = min(max_message_bytes, MIN_DECLARED_BYTES)  # fits every client and this server

    def limit(self, headers: Headers) -> tuple[int, str]:
        """This call's reply limit, and how it was set (for the message)."""
        declared = declared_receive_limit(headers.get(RECEIVE_LIMIT_KEY))
        if declared is None:
            client, how = DEFAULT_CLIENT_RECEIVE_BYTES, f"no {RECEIVE_LIMIT_KEY} declared: 4 MiB assumed"
        else:
            client, how = max(declared, MIN_DECLARED_BYTES), f"the client's {RECEIVE_LIMIT_KEY}={declared}"
        if client < self.max_message_bytes:
            return client, how
        return self.max_message_bytes, f"--max-message-bytes={self.max_message_bytes}"

    def num_tokens(self, num_seqs: int, counts: int | np.ndarray) -> int:
        """Tokens an append of ``counts`` hands out, counting a count past ``max_seq_len`` (which the core refuses
        anyway, with its own message) as ``max_seq_len``."""
        if isinstance(counts, int):
            return min(max(counts, 0), self.max_seq_len) * num_seqs
        return int(np.clip(counts, 0, self.max_seq_len).sum())

    def append_bound(self, num_seqs: int, total: int) -> int:
        """The largest AppendToken(Stream)Response of ``num_seqs`` sequences growing by ``total`` tokens."""
        new_blocks = min(self.num_blocks, total // self.block_size + num_seqs)
        return (3 * _FIELD_OVERHEAD + total * self.slot_bytes + new_blocks * self.block_bytes
                + num_seqs * self.copy_bytes)

    def check_append(self, num_seqs: int, counts: int | np.ndarray, rpc: str, headers: Headers) -> None:
        """Refuse (INVALID_ARGUMENT) an append whose reply might not fit (the call's ``headers`` are read only
        when the reply could be larger than 64 KiB)."""
        total = self.num_tokens(num_seqs, counts)
        if total > self.max_tokens_per_call:
            raise InvalidArgumentError(
                f"{rpc} of {total} tokens: at most --max-tokens-per-call={self.max_tokens_per_call} tokens a call "
                "(so that no call holds the pool for long); split it"
            )
        bound = self.append_bound(num_seqs, total)
        if bound <= self.always_fits:
            return
        max_bytes, how = self.limit(headers)
        if bound > max_bytes:
            per_token = self.slot_bytes + self.block_bytes / self.block_size
            room = max_bytes - 3 * _FIELD_OVERHEAD - num_seqs * (self.block_bytes + self.copy_bytes)
            raise InvalidArgumentError(
                f"{rpc}'s reply could take {bound} bytes, more than the {max_bytes} bytes this call may send "
                f"({how}); nothing was appended: append at most {max(0, int(room / per_token))} "
                f"tokens a call, or raise the limits"
            )

    def check_reply(self, num_bytes: int, rpc: str, headers: Headers, item_bytes: int, unit: str) -> None:
        """Refuse a reply of ``num_bytes`` that would not fit (``item_bytes`` per ``unit``, for the advice). Before a
        mutation that keeps it from being applied and lost; before a read it says why, instead of gRPC's bare
        RESOURCE_EXHAUSTED."""
        if num_bytes <= self.always_fits:
            return
        max_bytes, how = self.limit(headers)
        if num_bytes > max_bytes:
            raise InvalidArgumentError(
                f"{rpc}'s reply would take {num_bytes} bytes, more than the {max_bytes} bytes this call may send "
                f"({how}): ask for at most {max(1, (max_bytes - 1024) // item_bytes)} {unit} a call"
            )
