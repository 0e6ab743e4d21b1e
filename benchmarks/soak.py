"""Soak: load generator runs killed at random, for a long time; at the end no block may be held by a dead session.

    .venv/bin/python benchmarks/soak.py --minutes 20 --json out/soak.json        (make soak)

One kvpool-server (host backend). One survivor client holds a few sequences (and their KV) the whole time. In a
loop: start ``kvpool-loadgen -p 2 -c 64 --lengths sharegpt`` (two worker processes, each with its own session),
let it run 0.5-6 s, then SIGKILL its whole process group (main and workers, mid-AppendToken) -- or, one time in
five, let it finish. After each kill the reclamation latency is the time until Stats shows only the survivor's
sequences and blocks (polled every 2 ms). A worker killed in the few milliseconds between opening its session and
its first heartbeat leaves a session behind until its lease ends (5 s here); such sessions are counted (they hold
nothing unless the worker also registered in that window). At the end: blocks held by dead sessions (must be 0),
no session but the survivor's, CheckInvariants, the survivor's KV read back byte for byte, kills, latency.

First, and again at the end, a hostile phase (``benchmarks/hostile.py``, ``--hostile-seconds``, 30 s each) hits
every bound at once -- sessions past --max-sessions, 1 MiB client names, concurrent near-limit WriteKVs (a third
malformed) past --max-inflight-bytes, over-long prompts, long prompts sealed in a loop (the event log's bytes),
subscribers that never read, random bytes to every method, and the KV events' attackers (replay peers that
never read, malformed replay requests in a flood, one tenant's idle subscribers: benchmarks/hostile_zmq.py). The server must answer Stats after each, and its
resident memory after the last must stay within the pool plus HOSTILE_RSS_SLACK of its size before the first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_client.loadgen.pattern import kv_pattern, token_keys  # noqa: E402
from benchmarks.hostile import hostile_phase  # noqa: E402
from tests.conftest import start_server  # noqa: E402

POOL_BYTES = 256 << 20
HOSTILE_RSS_SLACK = 256 << 20  # interpreter, caches and allocator slack beyond the pool's own touched pages
BOUNDS = ["--max-sessions", "256", "--max-message-bytes", "8MiB", "--max-inflight-bytes", "16MiB",
          "--event-buffer-bytes", "4MiB", "--max-event-subscribers", "8", "--max-seq-len", "8192",
          "--fast-path-area-bytes", "64KiB"]  # small enough for hostile_fastpath's overflowing records


def kv_events_flags(work: Path) -> list[str]:
    """KV events on ZMQ (ipc in the soak's directory) when pyzmq and msgpack are there: the hostile phase's replay
    attackers need the replay socket (benchmarks/hostile_zmq.py)."""
    try:
        import msgpack  # type: ignore[import-untyped]  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        return []
    return ["--kv-events-publish", f"ipc://{work}/kv-pub", "--kv-events-replay", f"ipc://{work}/kv-replay",
            "--kv-events-model", "soak"]


def loadgen(target: str, seed: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvpool_client.loadgen.main", "--target", target, "-p", "2", "-c", "64",
           "--lengths", "sharegpt", "--completions", "400", "--seed", str(seed), "--no-progress"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hostile-seconds", type=float, default=30.0, help="each hostile phase (0: none)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kvpool-soak-"))
    server = start_server(work, "--pool-bytes", str(POOL_BYTES), "--session-ttl-ms", "5000", *BOUNDS,
                          *kv_events_flags(work), unix=True)
    latencies: list[float] = []
    kills = finished = lingering = 0
    hostile = []
    try:
        if args.hostile_seconds:
            hostile.append(hostile_phase(server.address, server.pid, args.hostile_seconds, args.seed))
            print("hostile phase:", json.dumps(hostile[-1]), flush=True)
        with KVPoolClient(server.address, client_name="soak-survivor") as survivor:
            seq_ids = [survivor.register() for _ in range(4)]
            survivor.append(seq_ids, 50)
            expected = {s: kv_pattern(token_keys(s, 0, 50), survivor.layout) for s in seq_ids}
            for s, kv in expected.items():
                survivor.write_kv(s, 0, kv)
            own_blocks = survivor.stats().num_blocks_used
            end = time.monotonic() + args.minutes * 60
            run = 0
            while time.monotonic() < end:
                run += 1
                proc = loadgen(server.address, run)
                if rng.random() < 0.2:
                    proc.wait()
                    finished += 1
                else:
                    time.sleep(rng.uniform(0.5, 6.0))
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    kills += 1
                killed_at = time.monotonic()
                while True:
                    stats = survivor.stats()
                    if stats.num_blocks_used == own_blocks and stats.num_sequences == len(seq_ids):
                        break
                    if time.monotonic() - killed_at > 30:
                        raise SystemExit(f"run {run}: not reclaimed after 30 s: {stats}")
                    time.sleep(0.002)
                latencies.append(time.monotonic() - killed_at)
                if len(survivor.list_sessions()) > 1:
                    lingering += 1
                if run % 20 == 0:
                    print(f"{run} runs, {kills} killed, p99 reclamation "
                          f"{np.percentile(latencies, 99) * 1000:.1f} ms", flush=True)
            if args.hostile_seconds:
                hostile.append(hostile_phase(server.address, server.pid, args.hostile_seconds, args.seed + 1))
                print("hostile phase:", json.dumps(hostile[-1]), flush=True)
            time.sleep(6)  # past the lease: every session of a dead worker is gone
            stats = survivor.stats()
            held_by_dead = stats.num_blocks_used - own_blocks
            sessions_left = len(survivor.list_sessions()) - 1
            invariants = survivor.check_invariants().ok
            intact = all(np.array_equal(survivor.read_kv(s), kv) for s, kv in expected.items())
    finally:
        server.stop()
    result = {
        "minutes": args.minutes, "runs": run, "killed": kills, "finished": finished,
        "reclamations": len(latencies), "reclamation_ms_p50": float(np.percentile(latencies, 50) * 1000),
        "reclamation_ms_p99": float(np.percentile(latencies, 99) * 1000),
        "reclamation_ms_max": float(max(latencies) * 1000), "blocks_held_by_dead_sessions": held_by_dead,
        "invariants_ok": invariants, "survivor_kv_intact": intact, "sessions_left_at_end": sessions_left,
        "runs_with_an_empty_session_lingering": lingering, "hostile_phases": hostile,
    }
    grew = hostile[-1]["rss_mib"]["after"] - hostile[0]["rss_mib"]["before"] if hostile else 0.0
    hostile_ok = all(h["stats_after"] == "OK" and h["pid_alive"] for h in hostile) and \
        grew * 2**20 <= POOL_BYTES + HOSTILE_RSS_SLACK
    hostile_ok = hostile_ok and not any("APPLIED TWICE" in h["answers"].get(kind, {}) for h in hostile
                                        for kind in ("fp-overflow", "fp-step"))
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if held_by_dead or sessions_left or not invariants or not intact or not hostile_ok:
        raise SystemExit("soak FAILED")


if __name__ == "__main__":
    main()
