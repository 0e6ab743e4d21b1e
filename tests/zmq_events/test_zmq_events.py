"""--kv-events-publish against a real server process, read by a ZMQ SUB client written to vLLM's contract
(zmq_consumer.py): BlockStored with the full blocks' token ids in order and their parents, BlockRemoved only when a
block's last copy goes, AllBlocksCleared opening each start, replay over the ROUTER socket, both msgpack layouts,
and sequence numbers that go up across a restart."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="KV events on ZMQ need pyzmq (requirements/server.txt)")
pytest.importorskip("msgpack", reason="KV events on ZMQ need msgpack (requirements/server.txt)")
from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_server.core.block_hash import chain_hashes  # noqa: E402
from kvpool_server.zmq_events.wire import engine_hash, model_mask  # noqa: E402
from tests.zmq_events.helpers import BLOCK_SIZE, POD, event_flags, prefill  # noqa: E402
from tests.zmq_events.zmq_consumer import Subscriber, decode_like_llmd, decode_like_vllm  # noqa: E402

MODEL = "llama-3-8b"
TOPIC = f"kv@{POD}@{MODEL}".encode()
MASK = model_mask(MODEL)


def keys(tokens: list[int], salt: bytes = b"", mask: int = MASK, num_public: int = 0) -> list[int]:
    """The engine keys kvpool publishes for ``tokens``' full blocks."""
    return [engine_hash(h, mask) for h in chain_hashes(tokens, BLOCK_SIZE, salt, num_public=num_public)]


def events_of(messages, layout: str = "array") -> list[tuple]:
    return [e for m in messages for e in decode_like_llmd(m.payload)] if layout == "array" else []


def test_block_stored_carries_full_blocks_tokens_in_order_and_parents(server_factory, ipc_dir) -> None:
    pytest.importorskip("msgspec", reason="vLLM's structs are msgspec's (requirements/dev.txt)")
    server = server_factory(*event_flags(ipc_dir, "--kv-events-model", MODEL))
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    opening = sub.replay(0)  # published before this subscriber joined: the start's AllBlocksCleared
    assert [decode_like_llmd(p) for _, p in opening] == [[("AllBlocksCleared",)]]
    with KVPoolClient(server.address) as client:
        prompt = [(5 * i + 3) % 1000 for i in range(3 * BLOCK_SIZE + 5)]
        prefill(client, prompt)
        first = sub.recv_all()
        assert [m.topic for m in first] == [TOPIC] and first[0].pod_and_model == (POD, MODEL)
        assert first[0].seq > opening[0][0]
        ((tag, hashes, parent, tokens, block_size, medium),) = decode_like_llmd(first[0].payload)
        assert (tag, parent, block_size, medium) == ("BlockStored", 0, BLOCK_SIZE, "CPU")
        assert tokens == prompt[: 3 * BLOCK_SIZE]  # the full blocks' ids, in order; the partial tail not yet
        assert hashes == keys(prompt)
        # A second prompt sharing two blocks: only its new blocks, whose parent is the shared second block.
        longer = prompt[: 2 * BLOCK_SIZE] + [900 + i for i in range(2 * BLOCK_SIZE)]
        prefill(client, longer)
        ((tag, hashes, parent, tokens, _, _),) = [e for m in sub.recv_all() for e in decode_like_llmd(m.payload)]
        assert (tag, parent, tokens) == ("BlockStored", keys(longer)[1], longer[2 * BLOCK_SIZE:])
        assert hashes == keys(longer)[2:]
        # The same bytes read with vLLM's msgspec structs (array_like=True).
        batch = decode_like_vllm(first[0].payload, array_like=True)
        (stored,) = batch.events
        assert type(stored).__name__ == "ArrayBlockStored" and batch.data_parallel_rank == 0
        assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == (keys(prompt), None,
                                                                                      prompt[: 3 * BLOCK_SIZE])
        # And with the older vLLM's structs (its example subscriber's: fewer fields).
        import msgspec

        from tests.zmq_events.vllm_schema import OldKVEventBatch

        (old,) = msgspec.msgpack.Decoder(OldKVEventBatch).decode(first[0].payload).events
        assert (old.block_hashes, old.token_ids, old.block_size, old.medium) == (
            keys(prompt), prompt[: 3 * BLOCK_SIZE], BLOCK_SIZE, "CPU")
    sub.close()


def test_map_layout_decodes_with_vllms_newest_structs(server_factory, ipc_dir) -> None:
    pytest.importorskip("msgspec", reason="vLLM's structs are msgspec's (requirements/dev.txt)")
    server = server_factory(*event_flags(ipc_dir, "--kv-events-model", MODEL, "--kv-events-layout", "map"))
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    with KVPoolClient(server.address) as client:
        prompt = list(range(100, 100 + 2 * BLOCK_SIZE))
        prefill(client, prompt)
        (message,) = sub.recv_all()
    batch = decode_like_vllm(message.payload, array_like=False)
    (stored,) = batch.events
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size, stored.medium) == (
        keys(prompt), None, prompt, BLOCK_SIZE, "CPU")
    with pytest.raises(Exception):  # noqa: B017 -- the array decoder refuses a map: the layouts differ
        decode_like_vllm(message.payload, array_like=True)
    sub.close()


def test_fork_and_copy_on_write_never_retract_a_held_block_eviction_does(server_factory, ipc_dir) -> None:
    server = server_factory(*event_flags(ipc_dir, "--kv-events-model", MODEL), "--num-blocks", "12")
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    stored: set[int] = set()
    with KVPoolClient(server.address) as client:
        prompt = [(3 * i) % 500 for i in range(2 * BLOCK_SIZE + 4)]
        parent = prefill(client, prompt)
        children = client.fork(parent, 2)
        client.append(children, 3, token_ids=[1, 2, 3, 4, 5, 6])  # copy-on-write of the shared partial block
        client.free(parent)
        client.free(children[0])
        events = events_of(sub.recv_all())
        assert [e[0] for e in events] == ["BlockStored"]  # children[1] still holds both blocks: no BlockRemoved
        stored.update(events[0][1])
        client.free(children[1])  # cached, evictable, still published: nothing removed until it is reused
        assert sub.recv_all() == []
        # Pressure: other prompts take the pool, evicting the cached blocks (their last copy).
        for k in range(8):  # 8 x 2 cached blocks: more than the 12 blocks of the pool
            other = [2000 + 50 * k + i for i in range(2 * BLOCK_SIZE + 1)]
            client.free(prefill(client, other))
        events = events_of(sub.recv_all())
    removed = [h for e in events if e[0] == "BlockRemoved" for h in e[1]]
    assert set(keys(prompt)) <= set(removed)  # the first prompt's blocks went, once each
    assert len(removed) == len(set(removed))
    published = stored | {h for e in events if e[0] == "BlockStored" for h in e[1]}
    assert set(removed) <= published  # never a block the consumer was not told of
    sub.close()


def test_replay_from_a_sequence_number_returns_the_same_messages(server_factory, ipc_dir) -> None:
    server = server_factory(*event_flags(ipc_dir, "--kv-events-model", MODEL))
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    with KVPoolClient(server.address) as client:
        for k in range(4):
            prefill(client, [3000 + 100 * k + i for i in range(BLOCK_SIZE + 2)])
        live = sub.recv_all()
    assert len(live) == 4 and all(b.seq > a.seq for a, b in zip(live, live[1:], strict=False))
    # A consumer that missed the last three asks for them from the second's seq.
    assert sub.replay(live[1].seq) == [(m.seq, m.payload) for m in live[1:]]
    assert sub.replay(live[-1].seq + 1) == []
    assert sub.replay(live[1].seq, topic=TOPIC) == [(m.seq, m.payload) for m in live[1:]]
    assert sub.replay(live[1].seq, topic=b"kv@other@model") == []
    sub.close()


def test_sequence_numbers_go_up_across_a_restart_which_opens_with_all_blocks_cleared(server_factory,
                                                                                     ipc_dir) -> None:
    flags = event_flags(ipc_dir, "--kv-events-model", MODEL)
    server = server_factory(*flags)
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    with KVPoolClient(server.address) as client:
        prefill(client, list(range(2 * BLOCK_SIZE)))
        before = sub.recv_all()
    assert server.stop() == 0
    sub.close()
    server = server_factory(*flags)
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    opening = sub.replay(0)
    assert [decode_like_llmd(p) for _, p in opening] == [[("AllBlocksCleared",)]]
    assert opening[0][0] > before[-1].seq
    with KVPoolClient(server.address) as client:
        prefill(client, list(range(2 * BLOCK_SIZE)))
        after = sub.recv_all()
    assert after[0].seq > opening[0][0] and decode_like_llmd(after[0].payload)[0][0] == "BlockStored"
    sub.close()


def test_a_tcp_endpoint_on_loopback(server_factory, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = server_factory("--kv-events-publish", f"tcp://127.0.0.1:{port}", "--kv-events-model", MODEL,
                            "--kv-events-pod", POD)
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    with KVPoolClient(server.address) as client:
        prefill(client, list(range(BLOCK_SIZE)))
        (message,) = sub.recv_all()
    assert message.topic == TOPIC and decode_like_llmd(message.payload)[0][1] == keys(list(range(BLOCK_SIZE)))
    assert f"KV events tcp://127.0.0.1:{port}" in server.log()
    sub.close()


def test_a_router_index_from_the_events_equals_the_servers_cache(server_factory, ipc_dir) -> None:
    """A prefix-caching workload under eviction pressure (tests/client/test_events.py's): the index a consumer builds
    from the ZMQ events alone ends equal to the server's cache (a gRPC snapshot, in engine keys)."""
    from kvpool_client import fetch_snapshot
    from tests.client.test_events import Workload
    from tests.zmq_events.zmq_consumer import Index

    server = server_factory(*event_flags(ipc_dir, "--kv-events-model", MODEL), "--num-blocks", "48")
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    index = Index()
    for _, payload in sub.replay(0):
        index.apply(decode_like_llmd(payload))
    with KVPoolClient(server.address, session=False) as client:
        Workload(client, seed=3).run(150)
        messages = sub.recv_all(quiet_s=1.0)
        server_blocks = fetch_snapshot(client).blocks
    removed = 0
    for message in messages:
        events = decode_like_llmd(message.payload)
        removed += sum(len(e[1]) for e in events if e[0] == "BlockRemoved")
        index.apply(events)
    assert all(b.seq > a.seq for a, b in zip(messages, messages[1:], strict=False))
    expected = {engine_hash(h, MASK): (engine_hash(b.parent_hash, MASK) if b.parent_hash else 0,
                                       tuple(int(t) for t in b.token_ids)) for h, b in server_blocks.items()}
    assert index.blocks == expected and len(expected) > 0
    assert removed > 0, "no eviction: the pool was not under pressure"
    assert index.num_unknown_removed == 0 and index.num_missing_parent == 0
    sub.close()


def test_kvctl_follows_the_zmq_stream_and_replays(server_factory, ipc_dir, capsys) -> None:
    from kvpool_client.kvctl import main as kvctl

    server = server_factory(*event_flags(ipc_dir, "--kv-events-model", MODEL))
    with KVPoolClient(server.address) as client:
        prompt = list(range(500, 500 + 2 * BLOCK_SIZE))
        prefill(client, prompt)
    endpoints = ["--zmq", f"ipc://{ipc_dir}/pub", "--replay", f"ipc://{ipc_dir}/replay"]
    assert kvctl(["events", *endpoints, "--from-seq", "0", "--seconds", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "AllBlocksCleared" in lines[0]
    stored = lines[1].split()
    assert stored[2] == "BlockStored" and stored[3:5] == [f"{h:016x}" for h in keys(prompt)]
    assert lines[-1].startswith("2 messages, 2 events")
    assert kvctl(["events", *endpoints, "--from-seq", "0", "--seconds", "0.2", "--json"]) == 0
    first = capsys.readouterr().out.splitlines()[1]
    assert '"type": "BlockStored"' in first and '"token_ids": [500, 501' in first


def test_the_publishers_counters_are_scraped(server_factory, ipc_dir) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = server_factory(*event_flags(ipc_dir, "--kv-events-model", MODEL), "--metrics-address",
                            f"127.0.0.1:{port}")
    with KVPoolClient(server.address) as client:
        prefill(client, list(range(BLOCK_SIZE)))
        prefill(client, list(range(BLOCK_SIZE)), cache_extra_key=b"lora:x")  # withheld
    import time

    deadline = time.monotonic() + 10
    while True:  # the publisher thread sends shortly after the call returns
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("kvpool_kv_events_zmq"))
        if float(samples["kvpool_kv_events_zmq_messages_total"]) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert float(samples["kvpool_kv_events_zmq_messages_total"]) == 2  # the opening, the one published block
    assert float(samples["kvpool_kv_events_zmq_restates_total"]) == 1
    assert float(samples["kvpool_kv_events_zmq_withheld_blocks_total"]) == 1
    assert float(samples["kvpool_kv_events_zmq_dropped_batches_total"]) == 0
    assert float(samples["kvpool_kv_events_zmq_queued_bytes"]) == 0
    assert float(samples["kvpool_kv_events_zmq_replay_requests_total"]) == 0  # nobody asked for a replay
    assert float(samples["kvpool_kv_events_zmq_replay_malformed_total"]) == 0
    assert float(samples["kvpool_kv_events_zmq_replay_held_bytes"]) == 0


def test_several_pod_names_each_get_every_message(server_factory, ipc_dir) -> None:
    """Frontends sharing this host's pool, as the router knows them (llm-d: kv@<pod IP:port>@<model>): the same
    payload under each pod's topic, so a router credits every one of them with the pool's blocks."""
    pods = ["10.0.0.5:8000", "10.0.0.5:8001"]
    server = server_factory("--kv-events-publish", f"ipc://{ipc_dir}/pub", "--kv-events-model", MODEL,
                            "--kv-events-pod", ",".join(pods))
    sub = Subscriber(f"ipc://{ipc_dir}/pub")
    with KVPoolClient(server.address) as client:
        prompt = list(range(700, 700 + 2 * BLOCK_SIZE))
        prefill(client, prompt)
        first, second = sub.recv_all()
    assert [first.pod_and_model, second.pod_and_model] == [(pod, MODEL) for pod in pods]
    assert first.payload == second.payload and second.seq == first.seq + 1
    assert decode_like_llmd(first.payload)[0][1] == keys(prompt)
    sub.close()
