"""KVWire: token KV as it travels in WriteKV / ReadKV -- ``n`` tokens, each ``[L, 2, H, D]`` of the layout's
storage dtype, little-endian, back to back -- and how many tokens one ReadKV reply may carry."""

from __future__ import annotations

import numpy as np

from kvpool.layout import KVLayout
from kvpool_server.core import InvalidArgumentError

ENVELOPE_BYTES = 1024  # room for the response envelope around ReadKV's data


class KVWire:
    def __init__(self, layout: KVLayout, max_message_bytes: int) -> None:
        self.token_bytes: int = layout.token_bytes
        self.token_shape: tuple[int, ...] = layout.token_shape
        self.dtype: np.dtype = layout.storage_dtype.newbyteorder("<")
        self.max_read_tokens: int = max(1, (max_message_bytes - ENVELOPE_BYTES) // self.token_bytes)

    def decode(self, data: bytes | memoryview) -> np.ndarray:
        """WriteKV's ``data`` -> ``[n, L, 2, H, D]``, a view of ``data`` (no copy: a 64 MiB body stays 64 MiB);
        n >= 1."""
        num_tokens, remainder = divmod(len(data), self.token_bytes)
        if remainder or num_tokens == 0:
            raise InvalidArgumentError(
                f"WriteKV data is {len(data)} bytes; it must be a positive multiple of token_bytes={self.token_bytes}"
            )
        return np.frombuffer(data, dtype=self.dtype).reshape((num_tokens, *self.token_shape))

    def check_read(self, num_tokens: int) -> None:
        if num_tokens > self.max_read_tokens:
            raise InvalidArgumentError(
                f"ReadKV of {num_tokens} tokens exceeds the message limit; read at most "
                f"{self.max_read_tokens} tokens per call"
            )

    def encode(self, tokens: np.ndarray) -> bytes:
        """``[n, L, 2, H, D]`` from the pool -> ReadKV's ``data``."""
        return np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
