"""kvpool-loadgen's prefix-caching workloads end to end, real server and loadgen processes: chat turns hit the
previous turns, one resident copy of a shared prompt with caching (several without), beam search over a cached
prompt, and the event subscriber's counts against the server."""

from __future__ import annotations

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_client import KVPoolClient
from kvpool_client.loadgen.chat import make_chat_conversation
from kvpool_client.loadgen.workload import distribution

from .test_loadgen_e2e import loadgen

TINY = ("--backend", "host", "--head-dim", "1", "--block-size", "16", "--num-blocks", "512")
CHAT = ("--workload", "chat", "--turns", "3", "--turn-tokens", "20", "--processes", "2", "--concurrency", "4",
        "--completions", "6", "--max-len", "40", "--seed", "2")
SHARED = ("--workload", "shared-prefix", "--num-prompts", "1", "--shared-tokens", "160", "--unique-tokens", "16",
          "--max-len", "40", "--seed", "4")


def assert_ok(rc: int, summary: dict, output: str) -> None:
    assert rc == 0 and summary["ok"] and not summary["worker_errors"], output
    assert summary["verification"]["errors"] == 0 and summary["verification"]["checks_failed"] == 0
    assert summary["end"]["blocks_used"] == 0 and summary["end"]["invariants_ok"]


def server_snapshot(target: str) -> pb.SubscribeEventsResponse:
    """The server's cache as a fresh subscriber sees it first: one snapshot batch."""
    import grpc  # noqa: PLC0415

    with grpc.insecure_channel(target) as channel:
        stream = pb_grpc.KVPoolServiceStub(channel).SubscribeEvents(pb.SubscribeEventsRequest(), timeout=10)
        first = next(iter(stream))
        stream.cancel()
        return first


def test_chat_turns_hit_the_previous_turns(server_factory, tmp_path):
    server = server_factory(*TINY)
    rc, summary, output = loadgen(server.address, tmp_path, *CHAT)
    assert_ok(rc, summary, output)
    prefix = summary["prefix"]
    assert summary["run"]["completions"] == 6 and prefix["turns"] == 18 and summary["run"]["sequences"] == 18
    # what the earlier turns sealed, computed here from the conversations: every block the previous turn filled
    dist = distribution("uniform", 40)
    expected = 0
    for i in range(6):
        conv = make_chat_conversation(2, i, dist, 3, 20)
        expected += sum(conv.end_len(k - 1) // 16 * 16 for k in (1, 2))
    assert prefix["cached_tokens"] == prefix["expected_cached_tokens"] == expected > 0
    assert prefix["requests_with_hit"] == 6 * 2  # every turn but the first
    assert prefix["token_hit_rate"] == expected / prefix["prompt_tokens"]
    assert "cached tokens expected from the earlier turns" in output


def test_chat_without_the_cache_computes_every_prompt(server_factory, tmp_path):
    server = server_factory(*TINY)
    rc, summary, output = loadgen(server.address, tmp_path, *CHAT, "--no-prefix-cache")
    assert_ok(rc, summary, output)
    assert summary["prefix"]["cached_tokens"] == 0 and summary["prefix"]["requests_with_hit"] == 0
    assert summary["events"]["blocks_stored"] == 0 and summary["end"]["blocks_evictable"] == 0


def test_one_resident_copy_of_a_cached_prompt_and_one_per_request_without(server_factory, tmp_path):
    server = server_factory(*TINY)
    warm = ("--processes", "1", "--concurrency", "1", "--completions", "1")
    assert_ok(*loadgen(server.address, tmp_path, *SHARED, *warm))  # seals the prompt's 10 blocks
    busy = ("--processes", "2", "--concurrency", "4", "--completions", "12")
    rc, summary, output = loadgen(server.address, tmp_path, *SHARED, *busy)
    assert_ok(rc, summary, output)
    copies = summary["prefix"]["resident_copies"]["0"]
    assert summary["prefix"]["requests_with_hit"] == 12
    assert copies["peak_requests"] > 1 and copies["requests"] == 12 and copies["blocks"] == 10
    assert copies["peak_copies"] == copies["peak_copies_among_hits"] == 1 and copies["mean_copies"] == 1.0
    assert "resident copies peak 1" in output

    rc, summary, output = loadgen(server.address, tmp_path, *SHARED, *busy, "--no-prefix-cache")
    assert_ok(rc, summary, output)
    copies = summary["prefix"]["resident_copies"]["0"]
    assert summary["prefix"]["cached_tokens"] == 0 and copies["cold_requests"] == 12
    assert 1 < copies["peak_copies"] <= copies["peak_requests"] <= 4 and copies["mean_copies"] > 1


def test_beam_search_over_a_cached_prompt(server_factory, tmp_path):
    server = server_factory(*TINY)
    warm = ("--processes", "1", "--concurrency", "1", "--completions", "1")
    assert_ok(*loadgen(server.address, tmp_path, *SHARED, *warm))
    beam = ("--processes", "2", "--concurrency", "4", "--completions", "8", "--mode", "beam", "--beam-width", "4")
    rc, cached, output = loadgen(server.address, tmp_path, *SHARED, *beam)
    assert_ok(rc, cached, output)  # every beam's KV read back as written, cached prompt blocks included
    assert cached["prefix"]["requests_with_hit"] == 8 and cached["sharing"]["copies"] > 0
    assert cached["run"]["beams_pruned"] > 0
    assert cached["prefix"]["resident_copies"]["0"]["peak_copies"] == 1
    b = cached["beam"]
    assert b["peak_blocks_used"] < b["peak_blocks_no_caching_no_sharing"]
    assert "beam over the cached prompt" in output
    # the sharing line counts what the server holds (each process would count the cached blocks it holds)
    share = cached["sharing"]
    assert share["peak_blocks_with_sharing"] == cached["memory"]["peak_used_blocks"] == b["peak_blocks_used"]
    assert share["blocks_saved_at_peak"] > 0 and share["blocks_with_sharing_from"] == "server stats"

    rc, uncached, output = loadgen(server.address, tmp_path, *SHARED, *beam, "--no-prefix-cache")
    assert_ok(rc, uncached, output)
    # sharing without caching: each request holds its own prompt (its beams share it)
    assert uncached["beam"]["peak_blocks_used"] > b["peak_blocks_used"]


def test_the_event_subscriber_agrees_with_the_server(server_factory, tmp_path):
    """In a pool too small for every conversation, blocks are sealed and evicted; what the subscriber consumed
    adds up to the server's cache at the end (all of it evictable: no sequence is left)."""
    server = server_factory("--backend", "host", "--head-dim", "1", "--block-size", "16", "--num-blocks", "48")
    rc, summary, output = loadgen(server.address, tmp_path, *CHAT, "--completions", "16")  # ~8 blocks each
    assert_ok(rc, summary, output)
    events = summary["events"]
    assert events["available"] and events["caught_up"] and events["num_dropped"] == 0
    assert events["snapshots"] == 1 and events["snapshot_blocks"] == 0  # a fresh server: an empty snapshot
    assert events["blocks_removed"] > 0  # evictions
    assert events["cached_blocks"] == events["blocks_stored"] - events["blocks_removed"]
    with KVPoolClient(server.address) as client:
        assert client.stats().num_blocks_evictable == events["cached_blocks"] == summary["end"]["blocks_evictable"]
    snapshot = server_snapshot(server.address)
    assert snapshot.seq == events["last_seq"]
    assert sum(len(e.block_stored.block_hashes) for e in snapshot.events) == events["cached_blocks"]
    assert "blocks sealed (BlockStored)" in output


def test_a_second_run_finds_the_first_runs_own_prompt_blocks(server_factory, tmp_path):
    """The same seed on the same server: requests find even their own prompt parts cached (2 of the 40 unique
    tokens' blocks are matchable), and those blocks hold the bytes they would have written."""
    server = server_factory(*TINY)
    args = (*SHARED, "--unique-tokens", "40", "--processes", "2", "--concurrency", "2", "--completions", "6")
    assert_ok(*loadgen(server.address, tmp_path, *args))
    rc, summary, output = loadgen(server.address, tmp_path, *args)
    assert_ok(rc, summary, output)
    assert summary["prefix"]["cached_tokens"] == 6 * 192  # (200 - 1) // 16 = 12 blocks each


def test_a_pool_smaller_than_the_load_defers_and_preempts_and_completes(server_factory, tmp_path):
    """8 requests in flight of 4 prompts in a 30-block pool (one cold request needs 12): without admission control
    and preemption the processes' half-prefilled requests held every block and the run failed."""
    server = server_factory("--backend", "host", "--head-dim", "1", "--block-size", "16", "--num-blocks", "30")
    small = ("--workload", "shared-prefix", "--num-prompts", "4", "--shared-tokens", "160", "--unique-tokens", "16",
             "--max-len", "40", "--processes", "2", "--concurrency", "8", "--completions", "24")
    rc, summary, output = loadgen(server.address, tmp_path, *small)
    assert_ok(rc, summary, output)  # every KV byte read back, including requests that started again
    run = summary["run"]
    assert run["completions"] == 24 and run["prefill_deferrals"] > 0
    assert run["sequences"] == 24 + run["preemptions"]  # a preempted request registers again
    assert summary["prefix"]["token_hit_rate"] > 0
