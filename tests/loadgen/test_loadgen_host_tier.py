"""The host tier under the load generator, its KV checks on (docs/prefix-caching.md, "The host tier"): shared
prompts that need twice the pool are offloaded and restored by several processes at once and read back right; the
hit rate is higher than the same pool's without the tier; injected copy failures (offloads and restores cut short
halfway) cost hits, never correctness."""

from __future__ import annotations

import os

from kvpool_server.config import ServerConfig
from kvpool_server.grpc_api.server import build_server

from .test_loadgen_e2e import loadgen

# 128 B blocks (head_dim 1, float32, 16 tokens); 16 prompts of 160 shared tokens = 160 blocks, twice the pool
# KVPOOL_TEST_BACKEND=gpu (scripts/gpu_check.sh tier): a GPU pool, its tier pinned, the loadgen attached by CUDA IPC
BACKEND = "gpu" if os.environ.get("KVPOOL_TEST_BACKEND") == "gpu" else "host"
POOL = ("--backend", BACKEND, "--head-dim", "1", "--block-size", "16", "--num-blocks", "80")
WORKLOAD = ("--workload", "shared-prefix", "--num-prompts", "16", "--shared-tokens", "160", "--unique-tokens", "16",
            "--processes", "2", "--concurrency", "2", "--completions", "96", "--max-len", "40", "--seed", "3",
            "--verify", "both")
TIER = ("--host-tier-bytes", "64KiB")  # 512 blocks: every prompt fits


def clean(rc: int, summary: dict, output: str) -> dict:
    assert rc == 0 and not summary["worker_errors"], output
    assert summary["verification"]["errors"] == 0 and summary["verification"]["checks_failed"] == 0, output
    assert summary["end"]["invariants_ok"]
    return summary["prefix"]


def test_the_tier_raises_the_hit_rate_and_the_kv_checks_pass(server_factory, tmp_path) -> None:
    rates = {}
    for name, extra in (("pool only", ()), ("with tier", TIER)):
        server = server_factory(*POOL, *extra)
        prefix = clean(*loadgen(server.address, tmp_path, *WORKLOAD))
        rates[name] = prefix["token_hit_rate"]
    print("token hit rate:", rates)
    assert rates["with tier"] > rates["pool only"]


def test_injected_copy_failures_never_serve_wrong_kv(tmp_path) -> None:
    """In-process, so that the test reaches the tier's failure hook while two loadgen processes run. Both
    directions fail by construction, not by how a loaded run happens to go (CI: a run made one restore copy,
    which failed: restored 0): the server starts without the write-back thread (offload on eviction, a copy per
    evicting call); a first run leaves each of the 16 prompts' blocks in the pool or the tier; a flush (other
    prompts, 208 blocks through an 80-block pool) evicts every one of them into the tier, its first offload copy
    failing (an evicting call's blocks, at most 13: a prompt or two partly lost). The failing run then starts with
    the write-back thread, every prompt out of the pool and at least 13 of them whole in the tier: each one's first
    request makes a restore copy, and of three restore copies in a row (the first injected, then every third) at
    least one fails and one completes."""
    config = ServerConfig(address="127.0.0.1:0", backend=BACKEND, head_dim=1, block_size=16, num_blocks=80,
                          host_tier_bytes=128 << 10, host_tier_writeback_blocks=0).validate()  # 1024 slots: no drop
    handle = build_server(config)
    handle.start()
    tier = handle.service.tier
    assert tier is not None and tier.memory.wait_ready(30)
    core_tier = tier.tier
    address = f"127.0.0.1:{handle.port}"
    try:
        first = clean(*loadgen(address, tmp_path, *WORKLOAD))
        assert len(first["resident_copies"]) == 16  # every prompt ran (the seed's choice): in the pool or the tier
        tier.memory.inject_failures(1, restores=False)  # the flush's first offload: half copied, then it raises
        clean(*loadgen(address, tmp_path, *WORKLOAD, "--seed", "4", "--completions", "16"))
        failed_offloads, failed_restores, restored = (
            core_tier.num_offload_failed, core_tier.num_restore_failed, core_tier.num_restored)
        assert failed_offloads > 0
        tier.start_writeback(handle.service.guard.lock, 128)  # the default mode from now on
        tier.memory.fail_every(3)  # every third offload (write-back) and restore moves half its blocks, then raises
        tier.memory.inject_failures(1, offloads=False)  # and the next restore
        prefix = clean(*loadgen(address, tmp_path, *WORKLOAD))
    finally:
        handle.stop()
        handle.pool.close()
    print("prefix:", prefix, "offloads failed:", core_tier.num_offload_failed,
          "restores failed:", core_tier.num_restore_failed, "restored:", core_tier.num_restored,
          "written back ahead:", core_tier.num_written_back)
    assert core_tier.num_restore_failed > failed_restores and core_tier.num_restored > restored
