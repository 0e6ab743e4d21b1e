"""Large requests against a real server: what they cost in memory and how long Stats / Health wait meanwhile.

    .venv/bin/python benchmarks/bench_big_requests.py [--writes 16] [--write-mib 64] [--prompt-tokens 66000000]

Two sections, each on a fresh server (host backend):

- ``writes``: ``--writes`` concurrent WriteKVs of ``--write-mib`` each (one channel each); prints the server's peak
  RSS (VmHWM) over its RSS before the burst, and the slowest Stats and Health answer meanwhile.
  ``--inflight-mib`` is the server's ``--max-inflight-bytes`` (at least ``--write-mib`` + 1).
- ``prompts``: one RegisterSequence of an eighth of ``--prompt-tokens`` tokens, then one of all of them; prints how
  long each refusal took and the slowest Health and Stats answer meanwhile.

Stats and Health are asked every 10 ms by another process (``Prober``), so the client's own work does not delay
them. ``PYTHONPATH=<a checkout>/server`` runs the server of that checkout instead (before/after figures).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import subprocess
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpool.v1 import kvpool_pb2 as pb  # noqa: E402
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc  # noqa: E402
from tests.conftest import start_server  # noqa: E402

MiB = 1 << 20
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def memory(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


PROBE = """
import sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvpool.v1 import kvpool_pb2 as pb, kvpool_pb2_grpc as pb_grpc
channel = grpc.insecure_channel(sys.argv[1])
stub, health = pb_grpc.KVPoolServiceStub(channel), health_pb2_grpc.HealthStub(channel)
calls = {"Stats": lambda: stub.Stats(pb.StatsRequest(), timeout=60),
         "Health": lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=60)}
worst, count = dict.fromkeys(calls, 0.0), 0
print("ready", flush=True)
import select
while not select.select([sys.stdin], [], [], 0.01)[0]:
    for name, call in calls.items():
        start = time.perf_counter()
        call()
        worst[name] = max(worst[name], time.perf_counter() - start)
    count += 1
print(" ".join(f"{k}={v}" for k, v in worst.items()), count, flush=True)
"""


class Prober:
    """Another process asking Stats and Health every 10 ms (its own GIL: the client's work does not delay it)
    until ``end()``, which returns the slowest answer of each (seconds) and how many rounds were asked."""

    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE, address], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def end(self) -> tuple[dict[str, float], int]:
        out, _ = self.proc.communicate("stop\n", timeout=120)
        words = out.split()
        return {k: float(v) for k, v in (w.split("=") for w in words[:-1])}, int(words[-1])


def writes(tmp: Path, count: int, write_mib: int, inflight_mib: int) -> None:
    server = start_server(tmp, "--pool-bytes", "256MiB", "--max-seq-len", "262144", "--max-message-bytes", f"{write_mib + 1}MiB",
                          "--max-inflight-bytes", f"{inflight_mib}MiB")
    try:
        token_bytes = 512
        num_tokens = write_mib * MiB // token_bytes
        data = os.urandom(num_tokens * token_bytes)
        channels = [grpc.insecure_channel(server.address, options=UNLIMITED) for _ in range(count)]
        stubs = [pb_grpc.KVPoolServiceStub(c) for c in channels]
        seq = stubs[0].RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        stubs[0].AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[num_tokens]))
        stubs[0].WriteKV(pb.WriteKVRequest(seq_id=seq, start_position=0, data=data[: 2 * MiB]))  # warm
        time.sleep(0.5)
        base = memory(server.pid, "VmRSS")
        prober = Prober(server.address)
        request = pb.WriteKVRequest(seq_id=seq, start_position=0, data=data)
        start = time.perf_counter()
        futures = [stub.WriteKV.future(request, timeout=120) for stub in stubs]
        codes: dict[str, int] = {}
        for future in futures:
            try:
                future.result()
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
            codes[code] = codes.get(code, 0) + 1
        elapsed = time.perf_counter() - start
        worst, rounds = prober.end()
        peak = memory(server.pid, "VmHWM")
        print(f"writes: {count} x {write_mib} MiB WriteKV, --max-inflight-bytes {inflight_mib}MiB: {codes} in "
              f"{elapsed:.2f} s; server RSS {base / MiB:.0f} MiB before, peak {peak / MiB:.0f} MiB "
              f"(+{(peak - base) / MiB:.0f} MiB); slowest Stats {worst['Stats'] * 1000:.0f} ms, slowest Health "
              f"{worst['Health'] * 1000:.0f} ms ({rounds} asked)")
    finally:
        server.stop()


def prompts(tmp: Path, num_tokens: int) -> None:
    server = start_server(tmp, "--max-message-bytes", f"{num_tokens // MiB + 2}MiB")
    try:
        channel = grpc.insecure_channel(server.address, options=UNLIMITED)
        stub = pb_grpc.KVPoolServiceStub(channel)
        for n in (num_tokens // 8, num_tokens):
            body = pb.RegisterSequenceRequest(prompt_token_ids=[1] * n).SerializeToString()
            register = channel.unary_unary("/kvpool.v1.KVPoolService/RegisterSequence")
            stub.Stats(pb.StatsRequest())
            prober = Prober(server.address)
            time.sleep(0.5)
            start = time.perf_counter()
            try:
                register(body, timeout=60)
                code, details = "OK", ""
            except grpc.RpcError as error:
                code, details = error.code().name, error.details() or ""
            elapsed = time.perf_counter() - start
            time.sleep(0.5)
            worst, rounds = prober.end()
            print(f"prompts: RegisterSequence of {n:,} tokens ({len(body) / MiB:.1f} MiB): {code} in "
                  f"{elapsed * 1000:.0f} ms ({details[:60]}...); slowest Health meanwhile "
                  f"{worst['Health'] * 1000:.0f} ms, Stats {worst['Stats'] * 1000:.0f} ms ({rounds} asked)")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--sections", default="writes,prompts")
    parser.add_argument("--writes", type=int, default=16)
    parser.add_argument("--write-mib", type=int, default=64)
    parser.add_argument("--inflight-mib", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=66_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-big-") as tmp:
        if "writes" in args.sections:
            writes(Path(tmp), args.writes, args.write_mib, args.inflight_mib)
        if "prompts" in args.sections:
            prompts(Path(tmp), args.prompt_tokens)


if __name__ == "__main__":
    main()
