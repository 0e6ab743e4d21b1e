"""kvctl against real kvpool-server processes: every command, text and --json, and its exit codes."""

from __future__ import annotations

import json
import subprocess
import time
import sys
from pathlib import Path

import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import KVPoolClient, UnavailableError
from kvpool_client.kvctl import EXIT_ERROR, EXIT_NO_SERVER, EXIT_NOT_DRAINED, main


def kvctl(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_stats_text_and_json(server, capsys):
    with KVPoolClient(server.address, session=False) as kv:  # its sequences outlive it
        seq = kv.register()
        kv.append([seq], 20)
        kv.fork(seq, 1)
    code, text, _ = kvctl(capsys, "--target", server.address, "stats")
    assert code == 0
    assert "2 used + 254 free + 0 evictable = 256" in text and "sequences" in text and "shared blocks" in text
    code, out, _ = kvctl(capsys, "stats", "--target", server.address, "--json")
    data = json.loads(out)
    assert code == 0
    assert (data["num_blocks_used"], data["num_sequences"], data["num_tokens"], data["num_blocks_shared"]) == (
        2, 2, 40, 2)
    assert data["backend"] == "host"


def test_block_table(unix_server, capsys):
    with KVPoolClient(unix_server.address, session=False) as kv:
        seq = kv.register()
        kv.append([seq], 20)
        expected = [int(b) for b in kv.block_table(seq).block_ids]
    socket_path = unix_server.address.removeprefix("unix:")
    code, out, _ = kvctl(capsys, "block-table", str(seq), "--unix-socket", socket_path, "--json")
    assert code == 0 and json.loads(out) == {"seq_id": seq, "num_tokens": 20, "block_size": 16,
                                             "block_ids": expected}
    code, text, _ = kvctl(capsys, "block-table", str(seq), "--unix-socket", socket_path)
    assert f"-> block {expected[1]}" in text
    code, _, err = kvctl(capsys, "block-table", "12345", "--unix-socket", socket_path)
    assert code == EXIT_ERROR and "NOT_FOUND" in err


def test_health(server, capsys):
    code, out, _ = kvctl(capsys, "health", "--target", server.address, "--json")
    assert code == 0 and json.loads(out)["status"] == "SERVING"
    code, _, err = kvctl(capsys, "health", "--target", server.address, "--service", "no.such.Service")
    assert code == EXIT_ERROR and "NOT_FOUND" in err


def test_session_listings(server, capsys):
    with KVPoolClient(server.address, client_name="kvctl-test") as kv:
        seq = kv.register()
        kv.append(seq, 20)
        code, out, _ = kvctl(capsys, "sessions", "--target", server.address)
        assert code == 0 and "kvctl-test" in out
        code, out, _ = kvctl(capsys, "sequences", "--session", str(kv.session_id), "--target", server.address)
        assert code == 0 and str(seq) in out
    code, _, err = kvctl(capsys, "sequences", "--session", "0x1", "--target", server.address)
    assert code == EXIT_ERROR and "NOT_FOUND" in err


def test_events_follow_the_prefix_cache(server, capsys):
    """A block filled with token ids and sealed (by the next append) appears as BlockStored."""
    with KVPoolClient(server.address, session=False) as kv:
        seq = kv.register()
        kv._stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[17], token_ids=list(range(17))))
        kv._stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[1], token_ids=[99]))  # seals block 0
    code, out, _ = kvctl(capsys, "--target", server.address, "events", "--batches", "1", "--json")
    first, _, rest = out.strip().partition("\n")  # one line a batch, then the summary
    batch = json.loads(first)
    assert code == 0 and batch["snapshot"] is True
    stored = [e for e in batch["events"] if e["type"] == "BlockStored"]
    assert len(stored) == 1 and stored[0]["token_ids"] == list(range(16)) and stored[0]["block_size"] == 16
    assert json.loads(rest)["batches"] == 1


def test_drain_refuses_new_sessions_lets_live_ones_finish_and_waits(server, capsys):
    live = KVPoolClient(server.address, client_name="live")
    seq = live.register()
    live.append(seq, 20)
    code, out, _ = kvctl(capsys, "--target", server.address, "drain", "--json")
    assert code == 0 and json.loads(out) == {"draining": True, "num_sessions": 1, "num_sequences": 1,
                                             "drained": False}
    with KVPoolClient(server.address) as newcomer:
        assert newcomer.health() == "NOT_SERVING"
        with pytest.raises(UnavailableError, match="draining"):
            newcomer.register()  # a new session is refused
        with pytest.raises(UnavailableError, match="draining"):
            KVPoolClient(server.address, session=False).register()  # and a session-less sequence
    live.append(seq, 5)  # the live session goes on
    (child,) = live.fork(seq, 1)
    live.close()
    code, out, _ = kvctl(capsys, "--target", server.address, "drain", "--wait", "5")
    assert code == 0 and "0 sessions and 0 sequences live -- drained" in out


def test_drain_wait_that_runs_out_fails_and_names_what_is_still_live(server, capsys):
    """Issue 20 item 13: a session-less sequence never ends, so the wait runs out: exit 5, not 0."""
    with KVPoolClient(server.address, session=False) as kv:  # its sequence outlives it
        orphan = kv.register()
        kv.append(orphan, 20)
    live = KVPoolClient(server.address, client_name="still-here")
    live.append(live.register(), 5)
    try:
        code, out, _ = kvctl(capsys, "--target", server.address, "drain", "--wait", "0.5")
        assert code == EXIT_NOT_DRAINED == 5
        assert "not drained after --wait 0.5 s; still live:" in out
        assert f"session {live.session_id:#x} (still-here): 1 sequences, 1 blocks" in out
        assert f"1 session-less sequences (seq_id {orphan})" in out
        live.close()
        code, out, _ = kvctl(capsys, "--target", server.address, "drain", "--wait", "0.5", "--json")
        data = json.loads(out)
        assert code == EXIT_NOT_DRAINED and data["drained"] is False
        assert data["still_live"] == {"sessions": [], "num_sessionless_sequences": 1, "sessionless_seq_ids": [orphan]}
        with KVPoolClient(server.address, session=False) as kv:
            kv.free([orphan])
        code, out, _ = kvctl(capsys, "--target", server.address, "drain", "--wait", "5")
        assert code == 0 and "-- drained" in out
    finally:
        live.close()


def test_no_server_fails_fast(capsys, tmp_path):
    code, _, err = kvctl(capsys, "stats", "--unix-socket", str(tmp_path / "none.sock"))
    assert code == EXIT_NO_SERVER and "no unix socket at" in err and "none.sock" in err


def test_top_json_lines_and_rates(server, capsys):
    with KVPoolClient(server.address, session=False) as kv:  # its sequences outlive it
        kv.append([kv.register()], 33)
    code, out, _ = kvctl(capsys, "top", "--target", server.address, "--json", "--iterations", "2",
                         "--interval", "0.05")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(lines) == 2
    assert lines[-1]["blocks_used"] == 3 and lines[-1]["tokens"] == 33 and lines[-1]["stats_latency_ms_p50"] > 0
    assert lines[-1]["cow_copies_per_s"] == lines[-1]["prefix_lookup_tokens_per_s"] == 0
    assert lines[-1]["appended_tokens_per_s"] == 0  # nothing appended between the two polls


def test_stats_counts_appended_tokens_and_evicted_blocks(server):
    """Stats counts the tokens appended since start, read through a real server (evictions: tests/core)."""
    with KVPoolClient(server.address) as kv:
        before = kv.stats()
        seq = kv.register()
        kv.append([seq], 33)
        kv.append([seq], 2)
        kv.free(seq)
        after = kv.stats()
    assert after.num_tokens_appended - before.num_tokens_appended == 35


def test_top_rates_are_of_counters_that_only_grow():
    """Issue 35 item 6: no net-change rate (frees made 'tokens' fall: -262/s); a counter's growth only."""
    from kvpool_client.kvctl_top import Sample, rates
    from kvpool_client.types import PoolStats

    def stats(tokens, copies, looked_up, hit, appended, evicted):
        return PoolStats(64, 0, 64, 1.0, tokens, 0, 0.0, 0, copies, 3, 16, 8192, prefix_query_tokens=looked_up,
                         prefix_hit_tokens=hit, num_tokens_appended=appended, num_blocks_evicted=evicted)

    got = rates(Sample(0.0, stats(1000, 5, 100, 40, 5000, 10), 0.001),
                Sample(2.0, stats(476, 9, 900, 440, 5600, 14), 0.001))
    assert got == {"appended_tokens_per_s": 300.0, "evicted_blocks_per_s": 2.0, "cow_copies_per_s": 2.0,
                   "prefix_lookup_tokens_per_s": 400.0, "prefix_hit_tokens_per_s": 200.0,
                   "tier_offloads_per_s": 0.0, "tier_restores_per_s": 0.0}
    assert all(rate >= 0 for rate in got.values())


def test_top_live_view_renders(server):
    """The rich view, from the console script in a subprocess (rich writes to a non-tty plainly)."""
    script = Path(sys.executable).with_name("kvctl")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvpool_client.kvctl"]
    result = subprocess.run(cmd + ["top", "--target", server.address, "--iterations", "2", "--interval", "0.05"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "kvctl top" in result.stdout and "usage" in result.stdout and "Stats latency" in result.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("kvctl ")


def test_stats_and_top_count_evictable_blocks(server, capsys):
    """used + free + evictable = total: a freed prompt's sealed blocks stay cached, held by no sequence (24.6)."""
    with KVPoolClient(server.address) as kv:
        seq, _ = kv.register_prompt(list(range(40)))
        kv.append([seq], 40, token_ids=list(range(40)))
        kv.append([seq], 1, token_ids=[40])  # seals the prompt's full blocks
        kv.free(seq)
    code, out, _ = kvctl(capsys, "--target", server.address, "stats", "--json")
    data = json.loads(out)
    assert code == 0 and data["num_blocks_evictable"] > 0
    assert data["num_blocks_used"] + data["num_blocks_free"] + data["num_blocks_evictable"] == data["num_blocks_total"]
    code, text, _ = kvctl(capsys, "--target", server.address, "stats")
    assert f"0 used + {data['num_blocks_free']} free + {data['num_blocks_evictable']} evictable = 256" in text
    code, out, _ = kvctl(capsys, "--target", server.address, "top", "--json", "--iterations", "1")
    view = json.loads(out)
    assert view["blocks_evictable"] == data["num_blocks_evictable"]
    assert view["blocks_used"] + view["blocks_free"] + view["blocks_evictable"] == view["blocks_total"]


def test_a_drain_can_be_undone(server, capsys):
    """kvctl drain --resume (24.7): SERVING again, and new sessions are taken again."""
    assert kvctl(capsys, "--target", server.address, "drain")[0] == 0
    code, out, _ = kvctl(capsys, "--target", server.address, "health")
    assert code == EXIT_ERROR and "NOT_SERVING (draining" in out and "--resume" in out
    with KVPoolClient(server.address) as kv, pytest.raises(UnavailableError, match="draining"):
        kv.register()
    code, out, _ = kvctl(capsys, "--target", server.address, "drain", "--resume", "--json")
    assert code == 0 and json.loads(out)["draining"] is False
    deadline = time.monotonic() + 10  # the health status is set on the server's loop just after the reply
    while kvctl(capsys, "--target", server.address, "health")[0] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with KVPoolClient(server.address) as kv:
        assert kv.append([kv.register()], 3).slot_mapping.size == 3
    assert kvctl(capsys, "--target", server.address, "drain", "--resume")[0] == 0  # idempotent
