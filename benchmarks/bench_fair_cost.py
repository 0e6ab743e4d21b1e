"""The fair share's own cost on the fast-path thread, this tree against an older one's (``--before DIR``: a tree's
``git archive REV server common`` unpacked in DIR), each in a process of its own with its own PYTHONPATH, in turn,
seven times each (``--runs``); median and minimum, in microseconds of CPU time (a loaded machine's preemptions do not count).

    --records N   per record: a pass's ``FairChannels.order`` of two channels and the record's ``charge``, N records
    --steps N     per decode step: N appends of one token to 256 sequences over the fast path, from a client
                  process, to a server in the measuring process whose fast-path thread parks after every record (no
                  spin: its CPU time is the records' work and the park's); that thread's CPU time a step

    cd benchmarks && ../.venv/bin/python bench_fair_cost.py --records 100000 --before DIR
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


class Seat:
    """What FairChannels reads of a channel: its session and tenant."""

    def __init__(self, session_id: int) -> None:
        self.session_id, self.tenant = session_id, None


def record_cost_once(records: int) -> float:
    """Microseconds per record of the fair share's work on the fast-path thread, with whichever tree is on the
    path: each record one pass's ``order`` of two channels and one ``charge``."""
    from kvpool_server.config import ServerConfig
    from kvpool_server.fastpath.fair_channels import FairChannels
    from kvpool_server.service.build import build_service

    service, _ = build_service(ServerConfig(backend="host", num_blocks=256, head_dim=1).validate())
    try:
        seats = [Seat(service.guard.sessions.open().session_id) for _ in range(2)]
        fair = FairChannels(service, lambda: None)
        started = time.thread_time()  # this thread's CPU time: a loaded machine's preemptions do not count
        for i in range(records):
            for _ in fair.order(seats):  # type: ignore[arg-type]
                pass
            fair.charge(seats[i & 1], 20e-6)  # type: ignore[arg-type]
        return (time.thread_time() - started) / records * 1e6
    finally:
        service.hasher.stop()
        service.guard.pool.close()


def step_client(address: str, steps: int) -> None:
    """The --steps client: 256 sequences, "ready", then (on a line in) ``steps`` appends, "done"."""
    from kvpool_client import KVPoolClient

    with KVPoolClient(address, lease_ttl_s=60.0) as client:
        ids = [client.register() for _ in range(256)]
        client.append(ids, 1)
        assert client.fast_path_open, "no fast path"
        print("ready", flush=True)
        sys.stdin.readline()
        for _ in range(steps):
            client.append(ids, 1)
        print("done", flush=True)


def step_cost_once(steps: int) -> float:
    """Microseconds of the fast-path thread's CPU time per decode step (see the module docstring)."""
    from kvpool_server.config import load_config
    from kvpool_server.fastpath import server as fast_path_server
    from kvpool_server.grpc_api.server import build_server

    fast_path_server.SPIN_S = 0.0  # type: ignore[misc]  # park after every record: no spin in the CPU time
    handle = build_server(load_config(["--backend", "host", "--head-dim", "1", "--num-blocks", str(1 << 19),
                                       "--max-seq-len", "8192", "--address", "127.0.0.1:0"]))
    handle.start()
    try:
        assert handle.fast_path is not None
        client = subprocess.Popen([sys.executable, __file__, "--step-client", f"127.0.0.1:{handle.port}",
                                   str(steps)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert client.stdin is not None and client.stdout is not None
        assert client.stdout.readline() == "ready\n", "the client did not start"
        clock = time.pthread_getcpuclockid(handle.fast_path.thread.ident or 0)
        started = time.clock_gettime(clock)
        client.stdin.write("go\n")
        client.stdin.flush()
        assert client.stdout.readline() == "done\n", "the client failed"
        used = time.clock_gettime(clock) - started
        client.wait(60)
        return used / steps * 1e6
    finally:
        handle.stop()
        handle.pool.close()


def alternate(mode: str, count: int, before: str | None, unit: str, runs: int) -> None:
    """``mode`` (--record-once or --step-once) in a process of this tree and of ``before``'s, in turn, ``runs``
    times each."""
    trees = {"this tree": None, **({f"before ({before})": before} if before else {})}
    costs: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(runs):
        for name, tree in trees.items():
            env = dict(os.environ)
            if tree:
                env["PYTHONPATH"] = ":".join((f"{tree}/server", f"{tree}/common", env.get("PYTHONPATH", "")))
            out = subprocess.run([sys.executable, __file__, mode, str(count)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            costs[name].append(float(out.split()[-1]))
    for name, values in costs.items():
        print(f"{name}: {statistics.median(values):.2f} us {unit} (median of {runs}; minimum {min(values):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--records", type=int, metavar="N", help="the cost per record (N records a run)")
    what.add_argument("--steps", type=int, metavar="N", help="the fast-path thread's CPU time per decode step "
                      "(N steps a run)")
    what.add_argument("--record-once", type=int, help=argparse.SUPPRESS)
    what.add_argument("--step-once", type=int, help=argparse.SUPPRESS)
    what.add_argument("--step-client", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--before", metavar="DIR", help="also an older tree unpacked in DIR")
    parser.add_argument("--runs", type=int, default=7, help="runs of each tree")
    args = parser.parse_args()
    before = args.before and os.path.abspath(args.before)
    if args.step_client:
        step_client(args.step_client[0], int(args.step_client[1]))
    elif args.record_once or args.step_once:
        print(f"{record_cost_once(args.record_once) if args.record_once else step_cost_once(args.step_once):.3f}")
    elif args.records:
        alternate("--record-once", args.records, before, "a record", args.runs)
    else:
        alternate("--step-once", args.steps, before, "of the fast-path thread a step", args.runs)


if __name__ == "__main__":
    main()
