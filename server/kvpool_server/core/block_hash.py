"""The block hash, for the core: its one definition is kvpool-common's ``kvpool.block_hash`` (docs/prefix-caching.md
gives the encoding), shared with the engines' in-process baseline (``LocalBlockCache``) so that both hash alike."""

from kvpool.block_hash import (
    DOMAIN,
    HEADER_CACHE_SIZE,
    MAX_EXTRA_KEY_BYTES,
    NATIVE,
    NONE_HASH,
    PUBLIC_SALT,
    block_hash,
    block_header,
    chain_encoded,
    chain_hashes,
    hash_encoded,
    hash_rows,
    salt_of,
)

__all__ = ["DOMAIN", "HEADER_CACHE_SIZE", "MAX_EXTRA_KEY_BYTES", "NATIVE", "NONE_HASH", "PUBLIC_SALT", "block_hash",
           "block_header", "chain_encoded", "chain_hashes", "hash_encoded", "hash_rows",
           "salt_of"]
