"""Tenants on vLLM's wire: each tenant's blocks under a model name of its own (--kv-events-tenant-models), public
blocks under every one (with each model's engine keys), and a tenant without a model name never published -- no
private block ever appears under another tenant's name."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="KV events on ZMQ need pyzmq (requirements/server.txt)")
pytest.importorskip("msgpack", reason="KV events on ZMQ need msgpack (requirements/server.txt)")
from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_server.core.block_hash import chain_hashes  # noqa: E402
from kvpool_server.zmq_events.wire import engine_hash, model_mask  # noqa: E402
from tests.security.tenant_helpers import write_tokens  # noqa: E402
from tests.zmq_events.helpers import BLOCK_SIZE, POD, event_flags, prefill  # noqa: E402
from tests.zmq_events.zmq_consumer import Subscriber, decode_like_llmd  # noqa: E402

TOKENS = {"a": ("tok-a", "frontend"), "b": ("tok-b", "frontend"), "c": ("tok-c", "frontend")}
SHARING = "[tenants.a]\nshare_prefixes = true\n[tenants.b]\nshare_prefixes = true\n"
MODELS = {"a": "llama-a", "b": "llama-b"}  # c has none: never published
SYSTEM = [(11 * i) % 3000 for i in range(2 * BLOCK_SIZE)]  # a public system prompt: two full blocks


def topic(tenant: str) -> bytes:
    return f"kv@{POD}@{MODELS[tenant]}".encode()


def test_each_tenant_under_its_own_model_name_public_blocks_under_all(server_factory, ipc_dir, tmp_path: Path) -> None:
    tokens_file = write_tokens(tmp_path / "tokens.toml", TOKENS, SHARING)
    server = server_factory("--auth-tokens", str(tokens_file), *event_flags(
        ipc_dir, "--kv-events-tenant-models", ",".join(f"{t}={m}" for t, m in MODELS.items())))
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    opening = sub.replay(0)  # the start: AllBlocksCleared on each tenant's topic
    assert sorted(decode_like_llmd(p)[0][0] for _, p in opening) == ["AllBlocksCleared"] * 2
    prompt_a = SYSTEM + [5000 + i for i in range(BLOCK_SIZE + 3)]  # public, public, a's own block, 3 tokens
    prompt_b = [6000 + i for i in range(BLOCK_SIZE + 1)]
    prompt_c = [7000 + i for i in range(2 * BLOCK_SIZE + 1)]
    for token, prompt, public in (("tok-a", prompt_a, len(SYSTEM)), ("tok-b", prompt_b, 0), ("tok-c", prompt_c, 0)):
        with KVPoolClient(server.address, token=token, session=False) as client:
            prefill(client, prompt, public_prefix_len=public)
    messages = sub.recv_all()
    assert {m.topic for m in messages} == {topic("a"), topic("b")}  # nothing for c
    stored = {t: [e for m in messages if m.topic == topic(t) for e in decode_like_llmd(m.payload)] for t in MODELS}
    a_hashes = chain_hashes(prompt_a, BLOCK_SIZE, b"a", num_public=2)
    mask_a, mask_b = model_mask(MODELS["a"]), model_mask(MODELS["b"])
    public_a = [engine_hash(h, mask_a) for h in a_hashes[:2]]
    public_b = [engine_hash(h, mask_b) for h in a_hashes[:2]]
    # a: the public run, then its own block whose parent is the second public block (a's engine keys).
    assert [(e[1], e[2], e[3]) for e in stored["a"]] == [
        (public_a, 0, SYSTEM), ([engine_hash(a_hashes[2], mask_a)], public_a[1], prompt_a[2 * BLOCK_SIZE: 3 * BLOCK_SIZE])]
    # b: the public run under b's own keys (another model's engine keys), and b's own block; none of a's.
    b_own = [engine_hash(h, mask_b) for h in chain_hashes(prompt_b, BLOCK_SIZE, b"b")]
    assert [(e[1], e[2], e[3]) for e in stored["b"]] == [(public_b, 0, SYSTEM), (b_own, 0, prompt_b[:BLOCK_SIZE])]
    everything_b = {h for e in stored["b"] for h in e[1]}
    a_private = a_hashes[2]
    assert not everything_b & {engine_hash(a_private, mask_a), engine_hash(a_private, mask_b)}
    c_hashes = chain_hashes(prompt_c, BLOCK_SIZE, b"c")
    published = {h for events in stored.values() for e in events for h in e[1]}
    assert not published & {engine_hash(h, m) for h in c_hashes for m in (mask_a, mask_b)}
    sub.close()


def test_a_socket_per_model_has_its_own_consecutive_sequence_numbers(server_factory, ipc_dir, tmp_path: Path) -> None:
    """--kv-events-socket-per-model: tenant a's topic on the endpoint, b's on endpoint-1; each socket numbers its
    own messages without gaps (a consumer that reads a gap as a loss, like vLLM's example subscriber, replays
    nothing it should not), and each replay socket holds only its topic."""
    tokens_file = write_tokens(tmp_path / "tokens.toml", TOKENS, SHARING)
    server = server_factory("--auth-tokens", str(tokens_file), "--kv-events-socket-per-model", *event_flags(
        ipc_dir, "--kv-events-tenant-models", ",".join(f"{t}={m}" for t, m in MODELS.items())))
    subs = {"a": Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"),
            "b": Subscriber(f"ipc://{ipc_dir}/pub-1", f"ipc://{ipc_dir}/replay-1")}
    for k in range(3):
        for tenant in ("a", "b"):
            with KVPoolClient(server.address, token=f"tok-{tenant}", session=False) as client:
                prefill(client, [1000 * k + 100 * ord(tenant) + i for i in range(BLOCK_SIZE + 1)])
    for tenant, sub in subs.items():
        replayed = sub.replay(0)
        assert [decode_like_llmd(p)[0][0] for _, p in replayed] == ["AllBlocksCleared"] + ["BlockStored"] * 3
        seqs = [seq for seq, _ in replayed]
        assert seqs == list(range(seqs[0], seqs[0] + 4))  # consecutive
        live = sub.recv_all()
        assert [m.topic for m in live] == [topic(tenant)] * 3 and [m.seq for m in live] == seqs[1:]
        sub.close()
    assert "KV events ipc://" in server.log() and "pub-1" in server.log()
