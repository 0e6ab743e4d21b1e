"""Shared by tests/zmq_events: the server's KV event flags (ipc endpoints in a short directory) and a prefill."""

from __future__ import annotations

from kvpool_client import KVPoolClient

BLOCK_SIZE = 16
POD = "host-7"


def event_flags(ipc_dir: str, *extra: str) -> tuple[str, ...]:
    return ("--kv-events-publish", f"ipc://{ipc_dir}/pub", "--kv-events-replay", f"ipc://{ipc_dir}/replay",
            "--kv-events-pod", POD, *extra)


def prefill(client: KVPoolClient, prompt: list[int], **kw) -> int:
    """Register ``prompt``, append the rest of it with ids, then one decode token (which seals its full blocks)."""
    seq, cached = client.register_prompt(prompt, **kw)
    client.append(seq, len(prompt) - cached, token_ids=prompt[cached:])
    client.append(seq, 1, token_ids=[7])
    return seq
