#!/usr/bin/env python3
"""The host tier's start-up (issue 23): "SERVING within 1 s with a 64 GiB host tier; the tier ready in the
background (Health says SERVING; Stats and metrics say how much of the host tier is ready)".

    python3 benchmarks/bench_tier_startup.py                                         host backend, a 1 GiB tier
    python3 benchmarks/bench_tier_startup.py --backend gpu --host-tier-bytes 64GiB   the H200 (128 GiB of RAM)

Starts a real server process (``python -m kvpool_server --backend B --host-tier-bytes X``, on a unix socket in a
temp dir) and measures, from just before the process is started:

- ``serving_s``: the first standard health check that answers SERVING (polled every ``--poll-ms``, on a channel
  that reconnects every 10 ms, so the figure is the server's and not gRPC's back-off);
- what the tier had then: ``bytes_ready_at_serving`` of ``bytes_total`` (Stats' ``host_tier``, read right after);
- a RegisterSequence with a prompt (token ids: a prefix-cache lookup, both tiers) and an AppendToken with the
  prompt's tokens, then Free, each timed, with how much of the tier was ready when they ran (on the GPU with a
  64 GiB tier they run while it is still being pinned: the pool serves meanwhile);
- ``ready_s``: the first Stats whose ``host_tier.bytes_ready`` equals ``bytes_total`` (polled every ``--poll-ms``;
  a few of the (t, bytes_ready) samples are printed, all are in the JSON), and the Prometheus gauges
  ``kvpool_host_tier_ready_bytes`` / ``kvpool_host_tier_size_bytes`` at SERVING and at ready.

The times include the interpreter's start and imports (CuPy's, and the CUDA context, on the GPU): what an operator
waits for. Layouts: host, 4 layers x 2 KV heads x 64, float16 (32 KiB blocks); gpu, Llama-3-8B's (32 x 8 x 128,
bfloat16: 2 MiB blocks) -- 1 GiB on the host and 64 GiB on the GPU are both 32,768 tier blocks. Exit 1 if the tier
never became ready within ``--timeout`` or a call failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [str(ROOT / "server"), str(ROOT / "common"), str(ROOT / "client")]
sys.path[:0] = PACKAGES

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from kvpool_client import KVPoolClient  # noqa: E402

LAYOUTS = {
    "host": ["--num-layers", "4", "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "float16"],
    "gpu": ["--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16"],
}
# A channel that retries the connection every 10 ms while the socket is not there yet (gRPC's default: 1 s, then more)
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
                  ("grpc.max_reconnect_backoff_ms", 10)]
GAUGE = re.compile(r"^(kvpool_host_tier_ready_bytes|kvpool_host_tier_size_bytes)\s+(\S+)$", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(target: str, t0: float, proc: subprocess.Popen, timeout: float, poll_s: float) -> float:
    """Seconds from ``t0`` to the first health check that answers SERVING."""
    with grpc.insecure_channel(target, options=FAST_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() - t0 < timeout:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=max(poll_s, 0.05)).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - t0
            except grpc.RpcError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before SERVING")
            time.sleep(poll_s)
    raise TimeoutError(f"not SERVING after {timeout} s")


def gauges(metrics_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in GAUGE.finditer(text)}


def tier_ready(client: KVPoolClient) -> tuple[int, int]:
    """(bytes_ready, bytes_total) of the host tier, from Stats."""
    tier = client.stats().host_tier
    if tier is None:
        raise RuntimeError("Stats has no host_tier: the server was started without --host-tier-bytes?")
    return tier.bytes_ready, tier.bytes_total


def calls_meanwhile(client: KVPoolClient, t0: float, prompt_tokens: int) -> dict[str, Any]:
    """A RegisterSequence with a prompt, an AppendToken of its tokens and a Free, each timed, with how much of the
    tier was ready just before and just after them."""
    before, total = tier_ready(client)
    prompt = list(range(1, prompt_tokens + 1))
    t_start = time.monotonic()
    seq_id, cached = client.register_prompt(prompt)
    t_reg = time.monotonic()
    client.append(seq_id, prompt_tokens, token_ids=prompt)
    t_app = time.monotonic()
    client.free(seq_id)
    t_free = time.monotonic()
    after, _ = tier_ready(client)
    return {"at_s": t_start - t0, "register_ms": 1e3 * (t_reg - t_start), "append_ms": 1e3 * (t_app - t_reg),
            "free_ms": 1e3 * (t_free - t_app), "num_cached_tokens": cached, "prompt_tokens": prompt_tokens,
            "bytes_ready_before": before, "bytes_ready_after": after, "bytes_total": total,
            "before_tier_ready": after < total}


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="kvp-tierstart-", dir="/tmp")
    target = f"unix:{tmp}/s.sock"
    metrics_port = free_port()
    pool = ["--pool-bytes", args.pool_bytes] if args.pool_bytes else ["--num-blocks", str(args.num_blocks)]
    cmd = [sys.executable, "-m", "kvpool_server", "--backend", args.backend, "--host-tier-bytes",
           args.host_tier_bytes, *pool, "--unix-socket", f"{tmp}/s.sock",
           "--address", "", "--metrics-address", f"127.0.0.1:{metrics_port}", "--log-level", "WARNING",
           *LAYOUTS[args.backend], *args.server_arg]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(PACKAGES + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    log_path = Path(tmp) / "server.log"
    poll_s = args.poll_ms / 1e3
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        serving_s = wait_serving(target, t0, proc, args.timeout, poll_s)
        with KVPoolClient(target, fast_path=False) as client:
            at_serving, total = tier_ready(client)
            at_serving_s = time.monotonic() - t0
            gauges_at_serving = gauges(metrics_port)
            calls = calls_meanwhile(client, t0, args.prompt_tokens)
            samples: list[tuple[float, int]] = [(round(at_serving_s, 4), at_serving)]
            ready_s = at_serving_s if at_serving == total else None
            while ready_s is None and time.monotonic() - t0 < args.timeout:
                time.sleep(poll_s)
                ready, _ = tier_ready(client)
                samples.append((round(time.monotonic() - t0, 4), ready))
                if ready == total:
                    ready_s = samples[-1][0]
            gauges_at_end = gauges(metrics_port)
            tier = client.stats().host_tier
    except BaseException:
        proc.kill()
        proc.wait()
        sys.stderr.write(log_path.read_text(errors="replace"))
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(60)
    shutil.rmtree(tmp, ignore_errors=True)
    assert tier is not None
    return {
        "backend": args.backend, "host_tier_bytes": args.host_tier_bytes, "pool": " ".join(pool),
        "tier_blocks": tier.num_blocks, "block_bytes": total // max(tier.num_blocks, 1),
        "serving_s": serving_s, "bytes_total": total, "bytes_ready_at_serving": at_serving,
        "ready_at_serving": at_serving == total,
        "ready_s": ready_s, "bytes_ready_at_end": samples[-1][1], "calls": calls, "samples": samples,
        "gauges_at_serving": gauges_at_serving, "gauges_at_end": gauges_at_end, "server_rc": rc,
    }


def report(r: dict[str, Any], num_samples: int) -> None:
    gib = 2**30
    print(f"[{r['backend']}] host tier {r['host_tier_bytes']}: {r['tier_blocks']:,} blocks of "
          f"{r['block_bytes'] / 2**10:.0f} KiB; pool {r['pool']}")
    print(f"SERVING after       {r['serving_s']:.3f} s   (tier ready then: {r['bytes_ready_at_serving'] / gib:.2f} of "
          f"{r['bytes_total'] / gib:.2f} GiB)")
    c = r["calls"]
    print(f"calls at            {c['at_s']:.3f} s   RegisterSequence {c['register_ms']:.1f} ms "
          f"({c['num_cached_tokens']} of {c['prompt_tokens']} tokens cached), AppendToken {c['append_ms']:.1f} ms, "
          f"Free {c['free_ms']:.1f} ms; tier ready {c['bytes_ready_before'] / gib:.2f} -> "
          f"{c['bytes_ready_after'] / gib:.2f} GiB ({'before' if c['before_tier_ready'] else 'after'} the tier was ready)")
    ready = f"{r['ready_s']:.3f} s" if r["ready_s"] is not None else "never (timeout)"
    if r["ready_at_serving"]:
        ready += "   (the first Stats after SERVING: the tier was whole already)"
    print(f"tier ready after    {ready}")
    samples = r["samples"]
    step = max(1, len(samples) // num_samples)
    shown = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    print("  t (s)    bytes_ready (GiB)")
    for t, b in shown:
        print(f"  {t:7.3f}  {b / gib:8.2f}")
    print(f"metrics: at SERVING {r['gauges_at_serving']}, at the end {r['gauges_at_end']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("host", "gpu"), default="host")
    p.add_argument("--host-tier-bytes", default=None, help="the tier's size (default: 1GiB host, 64GiB gpu)")
    p.add_argument("--num-blocks", type=int, default=1024, help="the pool's blocks (default 1024)")
    p.add_argument("--pool-bytes", default="", help="the pool's size instead of --num-blocks (e.g. 100GiB)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="the prompt registered and appended (64)")
    p.add_argument("--poll-ms", type=float, default=10.0, help="health and Stats polling interval (10 ms)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up on SERVING / ready after this (600 s)")
    p.add_argument("--samples", type=int, default=8, help="(t, bytes_ready) samples printed (all in the JSON)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more server argument (repeat; e.g. --server-arg=--kv-layout=layer-major)")
    p.add_argument("--json", metavar="PATH", help="write the figures here")
    args = p.parse_args()
    if args.host_tier_bytes is None:
        args.host_tier_bytes = "64GiB" if args.backend == "gpu" else "1GiB"
    r = run(args)
    report(r, args.samples)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0 if r["ready_s"] is not None and r["bytes_ready_at_end"] == r["bytes_total"] else 1


if __name__ == "__main__":
    sys.exit(main())
