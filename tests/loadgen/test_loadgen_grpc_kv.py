"""kvpool-loadgen with the pool unmapped (issue 24.8): --kv-path grpc writes and verifies KV over WriteKV / ReadKV,
and --kv-path auto falls back to it, saying why, when the pool cannot be mapped (another host, container or IPC
namespace: the shared-memory segment is not there)."""

from __future__ import annotations

import pytest

from kvpool_client import KVPoolClient
from kvpool_client.loadgen import kv_path
from tests.loadgen.test_loadgen_e2e import POOL, assert_clean_run, loadgen

RUN = ("--processes", "2", "--concurrency", "4", "--completions", "12", "--max-len", "64", "--seed", "4")


@pytest.mark.parametrize("mode", ["plain", "beam"])
def test_kv_over_grpc(server_factory, tmp_path, mode):
    server = server_factory(*POOL)
    rc, summary, output = loadgen(server.address, tmp_path, *RUN, "--kv-path", "grpc", "--mode", mode)
    assert_clean_run(rc, summary, output, 12, server.address)
    assert summary["kv_path"] == {"path": "grpc", "why": ["--kv-path grpc"], "grpc_processes": 2}
    assert summary["latency"]["block_table"]["count"] == 0  # every check by ReadKV: nothing read the mapped pool
    assert summary["latency"]["read_kv"]["count"] > 0


@pytest.mark.parametrize("workload", [("--workload", "shared-prefix", "--shared-tokens", "64", "--unique-tokens",
                                       "16", "--num-prompts", "2"),
                                      ("--workload", "chat", "--turns", "2", "--turn-tokens", "16")])
def test_prefix_workloads_over_grpc(server_factory, tmp_path, workload):
    server = server_factory(*POOL)
    rc, summary, output = loadgen(server.address, tmp_path, *RUN, "--kv-path", "grpc", *workload)
    assert rc == 0 and summary["verification"]["errors"] == 0, output
    assert summary["kv_path"]["path"] == "grpc" and summary["prefix"]["cached_tokens"] > 0


def test_injected_errors_are_found_over_grpc(server_factory, tmp_path):
    server = server_factory(*POOL)
    rc, summary, output = loadgen(server.address, tmp_path, *RUN, "--kv-path", "grpc", "--inject-errors", "2")
    assert rc == 1 and summary["verification"]["errors_injected"] == 2 and summary["verification"]["errors"] >= 2


def test_a_pool_that_cannot_be_mapped_falls_back_to_grpc(server, monkeypatch):
    """What a process in another IPC namespace meets: the segment DescribePool names does not exist there."""

    def missing(self):
        raise FileNotFoundError(2, "No such file or directory", "/kvpool-1-elsewhere")

    monkeypatch.setattr(KVPoolClient, "attach", missing)
    with KVPoolClient(server.address) as client:
        pool, why = kv_path.map_pool(client, "auto")
        assert pool is None and "another host, or in another container or IPC namespace" in why
        with pytest.raises(kv_path.CannotAttach, match="--kv-path grpc"):
            kv_path.map_pool(client, "attach")


def test_grpc_excludes_what_needs_the_mapped_pool(tmp_path, capsys):
    from kvpool_client.loadgen.main import main

    for extra in (["--verify", "table"], ["--kv-source", "device"]):
        with pytest.raises(SystemExit):
            main(["--target", "127.0.0.1:1", "--kv-path", "grpc", *extra])
        assert "--kv-path grpc" in capsys.readouterr().err
