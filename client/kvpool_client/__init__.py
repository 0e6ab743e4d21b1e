"""kvpool client library."""

from kvpool_client.layout import KVLayout

__all__ = ["KVLayout"]
