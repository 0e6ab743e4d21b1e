"""kvpool-loadgen --workload shared-prefix: requests that share system prompts hit the prefix cache."""

from __future__ import annotations


from kvpool_client import KVPoolClient
from kvpool_client.loadgen.workload import (
    distribution,
    make_shared_prefix_request,
    request_token_ids,
    shared_token_ids,
)

from .test_loadgen_e2e import loadgen

TINY = ("--backend", "host", "--head-dim", "1", "--block-size", "16", "--num-blocks", "512")


def test_shared_prefix_hits_the_cache(server_factory, tmp_path):
    server = server_factory(*TINY)
    rc, summary, output = loadgen(
        server.address, tmp_path, "--workload", "shared-prefix", "--num-prompts", "2", "--shared-tokens", "160",
        "--unique-tokens", "16", "--processes", "2", "--concurrency", "2", "--completions", "20",
        "--max-len", "40", "--seed", "5",
    )
    assert rc == 0 and not summary["worker_errors"], output  # invariants held at the end too
    assert summary["run"]["completions"] == 20
    assert summary["verification"]["errors"] == 0 and summary["verification"]["checks_failed"] == 0
    assert "KV verification errors          0" in output
    prefix = summary["prefix"]
    assert prefix["prompt_tokens"] == 20 * 176
    # a hit takes the whole shared prompt (160 = 10 blocks); only the first requests per prompt (and ones that ran
    # alongside them, before the first sealed its blocks) can miss
    assert prefix["cached_tokens"] == prefix["requests_with_hit"] * 160
    assert prefix["requests_with_hit"] >= 20 - 2 * 2 - 2
    ideal = 160 / 176
    assert 0.7 * ideal <= prefix["token_hit_rate"] <= ideal
    assert prefix["prefill_tokens_saved"] == prefix["cached_tokens"]
    assert prefix["evictable_blocks_end"] > 0
    assert "token hit rate" in output
    with KVPoolClient(server.address) as client:
        stats = client.stats()
        assert stats.num_sequences == 0 and stats.num_blocks_used == 0
        assert stats.num_blocks_evictable == prefix["evictable_blocks_end"]


def test_invariants_after_a_cached_block_is_freed(server_factory):
    """Found by this workload: the server's CheckInvariants (on a snapshot) once lost the evictable LRU."""
    server = server_factory(*TINY)
    ids = list(range(1, 177))
    with KVPoolClient(server.address) as client:
        seq_id, cached = client.register_prompt(ids)
        assert cached == 0
        client.append([seq_id], len(ids), token_ids=ids)
        client.append([seq_id], 1, token_ids=[9])  # seals the prompt's full blocks
        client.free([seq_id])
        assert client.stats().num_blocks_evictable == 11
        seq_id, cached = client.register_prompt(ids)
        assert cached == 160
        client.free([seq_id])
        assert client.check_invariants().ok


def test_shared_prefix_requests_are_deterministic():
    dist = distribution("uniform", 64)
    a = [make_shared_prefix_request(1, i, dist, 4, 100, 10) for i in range(50)]
    assert a == [make_shared_prefix_request(1, i, dist, 4, 100, 10) for i in range(50)]
    assert {s.prompt_id for s in a} == {0, 1, 2, 3}
    assert all(s.prompt_len == 110 and 1 <= s.output_len for s in a)
    # shared ids depend on (seed, prompt, position) only; requests' own ids differ between requests
    assert (shared_token_ids(1, 2, 0, 100)[50:] == shared_token_ids(1, 2, 50, 100)).all()
    assert (shared_token_ids(1, 2, 0, 100) != shared_token_ids(1, 3, 0, 100)).any()
    assert (request_token_ids(1, 7, 100, 110) != request_token_ids(1, 8, 100, 110)).any()
