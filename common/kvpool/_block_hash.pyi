# The C loops of kvpool.block_hash (_block_hash.c): chain_loop's and many_flat_loop's signatures.
from collections.abc import Sequence

from typing_extensions import Buffer

def chain(prefix: bytes, parent: bytes, data: bytes, block_bytes: int, header_public: bytes, num_public: int,
          header: bytes, /) -> list[bytes]: ...
def many_flat(prefix: bytes, parents: Sequence[bytes], headers: Sequence[bytes], data: Buffer, block_bytes: int,
              /) -> list[bytes]: ...
