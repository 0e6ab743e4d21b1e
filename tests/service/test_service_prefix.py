"""Prefix caching through the service (docs/prefix-caching.md): token ids on appends, reuse on RegisterSequence,
KV that reads back exactly, hashes that two server processes agree on, tenants' salts, evictable blocks in Stats."""

from __future__ import annotations

from pathlib import Path

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.core.block_hash import chain_hashes
from tests.security.tenant_helpers import As, write_tokens
from tests.service.service_helpers import BLOCK_SIZE, connect, token_kv

import grpc

PROMPT = [(7 * i) % 50_000 for i in range(2 * BLOCK_SIZE + 5)]  # two full blocks and 5 more tokens


def prefill(stub, prompt=PROMPT) -> tuple[int, int]:
    """Register with the prompt, append what was not cached (with ids), write its KV; then one decode step (which
    seals the prompt's full blocks). Returns (seq_id, num_cached_tokens)."""
    reply = stub.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=prompt))
    seq, cached = reply.seq_id, reply.num_cached_tokens
    stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[len(prompt) - cached],
                                           token_ids=prompt[cached:]))
    stub.WriteKV(pb.WriteKVRequest(seq_id=seq, start_position=cached,
                                   data=token_kv(seq, range(cached, len(prompt))).tobytes()))
    stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], token_ids=[1]))
    return seq, cached


def test_cached_kv_reads_back_what_the_first_writer_wrote(server) -> None:
    with connect(server.address) as stub:
        a, cached = prefill(stub)
        assert cached == 0
        first_kv = stub.ReadKV(pb.ReadKVRequest(seq_id=a, num_tokens=2 * BLOCK_SIZE)).data
        stub.Free(pb.FreeRequest(seq_ids=[a]))
        stats = stub.Stats(pb.StatsRequest())
        assert stats.num_blocks_evictable == 2 and stats.num_blocks_used == 0

        b, cached = prefill(stub)
        assert cached == 2 * BLOCK_SIZE
        assert stub.ReadKV(pb.ReadKVRequest(seq_id=b, num_tokens=cached)).data == first_kv
        beams = stub.Fork(pb.ForkRequest(parent_seq_id=b, num_children=3)).child_seq_ids  # beam search
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=beams, token_ids=[2, 3, 4]))
        for beam in beams:
            assert stub.ReadKV(pb.ReadKVRequest(seq_id=beam, num_tokens=cached)).data == first_kv
        assert stub.Stats(pb.StatsRequest()).num_blocks_evictable == 0
        stub.CheckInvariants(pb.CheckInvariantsRequest())


def test_two_server_processes_agree_on_the_hashes(server_factory) -> None:
    hashes = []
    for _ in range(2):
        with connect(server_factory().address) as stub:
            seq, _ = prefill(stub)
            hashes.append(list(stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq)).block_hashes))
    assert hashes[0] == hashes[1] == [*chain_hashes(PROMPT, BLOCK_SIZE), b""]


def test_appends_without_token_ids_are_never_cached(server) -> None:
    with connect(server.address) as stub:
        a = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[a], num_tokens=[len(PROMPT)]))
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[a]))
        assert stub.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=PROMPT)).num_cached_tokens == 0
        assert list(stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=a)).block_hashes) == []


def test_different_tenants_never_share(server_factory, tmp_path: Path) -> None:
    server = server_factory("--auth-tokens", str(write_tokens(tmp_path / "tokens.toml")))
    with grpc.insecure_channel(server.address) as channel:
        tenant_a, tenant_b = As(channel, "tok-a"), As(channel, "tok-b")
        seq, _ = prefill(tenant_a)
        assert list(tenant_a.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq)).block_hashes)[:2] == \
            chain_hashes(PROMPT, BLOCK_SIZE, b"a")
        assert tenant_b.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=PROMPT)).num_cached_tokens == 0
        assert tenant_a.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=PROMPT)).num_cached_tokens == \
            2 * BLOCK_SIZE
        try:  # events carry every tenant's hashes and token ids: admins only
            next(tenant_a.SubscribeEvents(pb.SubscribeEventsRequest()))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
        else:
            raise AssertionError("a frontend subscribed to every tenant's KV events")
        admin = As(channel, "tok-admin").SubscribeEvents(pb.SubscribeEventsRequest())
        snap = next(admin)
        assert len(snap.events) == 2 and len(snap.events[1].block_stored.block_hashes) == 2  # cleared + a's 2 blocks
        admin.cancel()


def test_a_session_that_dies_before_sealing_leaves_nothing_matchable(server) -> None:
    with connect(server.address) as stub:
        sid = stub.OpenSession(pb.OpenSessionRequest(client_name="prefix")).session_id
        seq = stub.RegisterSequence(pb.RegisterSequenceRequest(session_id=sid, prompt_token_ids=PROMPT)).seq_id
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[len(PROMPT)], token_ids=PROMPT,
                                               session_id=sid))
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))  # its two full blocks were never sealed
        assert stub.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=PROMPT)).num_cached_tokens == 0
        stats = stub.Stats(pb.StatsRequest())
        assert stats.num_blocks_evictable == 0 and stats.num_blocks_used == 0


def test_append_stream_carries_token_ids(server) -> None:
    with connect(server.address) as stub:
        seq = stub.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=PROMPT)).seq_id
        requests = [pb.AppendTokenStreamRequest(seq_ids=[seq], num_tokens=[len(PROMPT)], token_ids=PROMPT),
                    pb.AppendTokenStreamRequest(seq_ids=[seq], token_ids=[9])]
        assert len(list(stub.AppendTokenStream(iter(requests)))) == 2
        hashes = list(stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq)).block_hashes)
        assert hashes == [*chain_hashes(PROMPT, BLOCK_SIZE), b""]
        bad = pb.AppendTokenStreamRequest(seq_ids=[seq], num_tokens=[2], token_ids=[1])
        try:
            list(stub.AppendTokenStream(iter([bad])))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        else:
            raise AssertionError("2 tokens with 1 token id were accepted")
        assert stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq)).num_tokens == len(PROMPT) + 1


def test_subscribe_events_snapshot_then_live_batches_then_resume(server) -> None:
    with connect(server.address) as stub:
        a, _ = prefill(stub)  # seals 2 blocks: batch 1
        stream = stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=10)
        snap = next(stream)
        assert snap.snapshot and snap.seq == 1 and snap.events[0].HasField("all_blocks_cleared")
        h0, h1 = chain_hashes(PROMPT, BLOCK_SIZE)
        stored = [e.block_stored for e in snap.events[1:]]  # the prompt's two blocks chain: one run
        assert [(list(s.block_hashes), s.parent_block_hash, list(s.token_ids), s.block_size) for s in stored] == [
            ([h0, h1], b"", PROMPT[: 2 * BLOCK_SIZE], BLOCK_SIZE)]
        b = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        tokens = list(range(BLOCK_SIZE))
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[b], num_tokens=[BLOCK_SIZE], token_ids=tokens))
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[b], token_ids=[0]))  # seals b's block: batch 2
        live = next(stream)
        assert (live.seq, live.snapshot, live.epoch) == (2, False, snap.epoch)
        assert [list(e.block_stored.token_ids) for e in live.events] == [tokens]
        stream.cancel()
        resume = stub.SubscribeEvents(pb.SubscribeEventsRequest(from_seq=2), timeout=10)
        resumed = next(resume)
        resume.cancel()
        assert (resumed.seq, resumed.snapshot) == (2, False)
        stub.Free(pb.FreeRequest(seq_ids=[a, b]))


def test_a_subscriber_does_not_hold_up_shutdown(server) -> None:
    import signal
    import time

    with connect(server.address) as stub:
        stream = stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=30)
        assert next(stream).snapshot
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 10


def test_prefix_cache_queries_and_hits_are_counted_in_stats_and_metrics():
    """Two registrations of the same 40-token prompt after the first was cached: queries 80, hits 32 (two full
    blocks; the partial third is never shared)."""
    from kvpool_server.core import KVCacheManager
    from kvpool_server.service.metrics import KVPoolMetrics

    manager = KVCacheManager(num_blocks=32, block_size=16)
    prompt = list(range(1000, 1040))
    first = manager.register(prompt_token_ids=prompt)
    manager.append(first, 40, token_ids=prompt)
    manager.append(first, 1, token_ids=[7])  # seals the full blocks
    manager.register(prompt_token_ids=prompt)
    stats = manager.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (80, 32)
    metrics = KVPoolMetrics()
    metrics.watch_pool(manager.stats)
    values = {s.name: s.value for f in metrics.registry.collect() for s in f.samples}
    assert values["kvpool_prefix_cache_queries_total"] == 80 and values["kvpool_prefix_cache_hits_total"] == 32
