"""The 256-sequence decode step with copy-on-write copies, at --tensor-parallel N = 1, 2, 4, 8 shards: the cost of
one AppendToken through the server's own code (parse, call scope, service, the core's append, the pool's copies and
clearing on every shard, the reply serialized), in process -- as benchmarks/servicer_step.py, plus the copies.

A beam-search-like workload keeps copies in every step: 256 live sequences; between two timed steps (untimed) 32 of
them are freed and 32 others forked once each, so the next step's AppendToken copies the partial last block of each
forked pair (about 30 copies a step; one in 16 steps a sequence opens a new block, which is cleared instead). Only
the AppendToken is timed: the median and the best of ``--steps`` steps per round, best round of ``--rounds``.

    python benchmarks/tp_decode_step.py                        # host backend, a small layout (any machine)
    python benchmarks/tp_decode_step.py --backend gpu          # Llama-3-8B layout (32 layers, 8 KV heads, 2 MiB blocks)
    python benchmarks/tp_decode_step.py --backend gpu --tp-devices 0,1,2,3,4,5,6,7   # N=8 on eight GPUs

Without --tp-devices every shard is on device 0 (N shards on one device: one upload, launch and synchronisation
for all of them, as for one shard) -- said in the output. ``--per-shard`` drives every shard on its own instead
(one launch a shard: the cost before one launch a device), to compare the two in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.config import ServerConfig

BATCH, FORKS_PER_STEP = 256, 32
LAYOUTS = {  # name: (num_layers, num_kv_heads, head_dim, dtype)
    "small": (2, 8, 16, "float16"),  # 8 KiB blocks: the host backend on a CI machine
    "llama": (32, 8, 128, "bfloat16"),  # Llama-3-8B: 2 MiB blocks
}


def build(backend: str, layout: str, n: int, num_blocks: int, devices: str) -> tuple:
    from kvpool_server.grpc_api.methods import RPCS
    from kvpool_server.service.build import build_service
    from kvpool_server.service.scope import CallScope

    layers, heads, dim, dtype = LAYOUTS[layout]
    config = ServerConfig(backend=backend, num_blocks=num_blocks, block_size=16, num_layers=layers,
                          num_kv_heads=heads, head_dim=dim, dtype=dtype, max_seq_len=8192, max_num_seqs=4096,
                          max_batch=4096, tensor_parallel=n, tp_devices=devices if n > 1 else "")
    service, admission = build_service(config)
    return service, CallScope(admission, None, None), RPCS["AppendToken"]


def run(backend: str, layout: str, n: int, steps: int, rounds: int, num_blocks: int, devices: str,
        per_shard: bool = False) -> dict:
    service, scope, append = build(backend, layout, n, num_blocks, devices)
    if per_shard and n > 1:  # the launches as before issue 26: one upload, launch and synchronisation a shard
        service.guard.pool.launch_per_shard()
    rng = np.random.default_rng(0)
    best_round: dict | None = None
    try:
        for round_index in range(rounds + 1):  # round 0: a warm-up (kernels compiled, caches and clocks up), untimed
            with scope.call("RegisterSequence") as call:
                ids = [service.register(call).seq_id for _ in range(BATCH)]
            with scope.call("AppendToken") as call:
                service.append(call, ids, [24] * BATCH)  # a prompt: every sequence ends in a partial block
            times, copies = [], 0
            for _step in range(steps):
                victims = rng.choice(BATCH, FORKS_PER_STEP, replace=False)  # untimed: prune 32 beams, fork 32
                keep = np.setdiff1d(np.arange(BATCH), victims)
                parents = rng.choice(keep, FORKS_PER_STEP, replace=False)
                with scope.call("Free") as call:
                    service.free(call, [ids[v] for v in victims])
                for v, p in zip(victims.tolist(), parents.tolist()):
                    with scope.call("Fork") as call:
                        ids[v] = service.fork(call, ids[p], num_children=1)[0]
                raw = pb.AppendTokenRequest(seq_ids=ids).SerializeToString()
                started = time.perf_counter()
                with scope.call("AppendToken") as call:
                    reply = append.encode(service, append.invoke(service, call, pb.AppendTokenRequest.FromString(raw)))
                    reply.SerializeToString()
                times.append(time.perf_counter() - started)
                copies += len(reply.copies)
            with scope.call("Free") as call:
                service.free(call, ids)
            result = {"median_us": statistics.median(times) * 1e6, "best_us": min(times) * 1e6,
                      "copies_per_step": copies / steps}
            if round_index and (best_round is None or result["median_us"] < best_round["median_us"]):
                best_round = result
    finally:
        service.guard.pool.close()
    assert best_round is not None
    return best_round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("host", "gpu"), default="host")
    parser.add_argument("--layout", choices=tuple(LAYOUTS), default=None,
                        help="default: small on the host backend, llama on the GPU")
    parser.add_argument("--tensor-parallel", default="1,2,4,8", help="shard counts to run, e.g. 1,2,4,8")
    parser.add_argument("--tp-devices", default="", help="CUDA device of each rank (one a rank; default: all on 0)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--per-shard", action="store_true",
                        help="drive every shard on its own (one launch a shard, the old way) instead of one launch "
                             "a device, to compare the two")
    parser.add_argument("--compare", action="store_true",
                        help="each N both ways, one launch a device then one launch a shard, side by side")
    parser.add_argument("--json", help="write the rows to this file")
    a = parser.parse_args()
    layout = a.layout or ("llama" if a.backend == "gpu" else "small")
    where = f"devices {a.tp_devices}" if a.tp_devices else "every shard on device 0" if a.backend == "gpu" else \
        "N host pools"
    launches = "one launch a shard" if a.per_shard else "one launch a device"
    if a.backend == "host":
        launches = "a NumPy copy a shard"  # host segments: no launches to group (--per-shard changes nothing)
    print(f"decode step: {BATCH} sequences, AppendToken with ~{FORKS_PER_STEP} forked pairs a step, {a.backend} "
          f"backend, {layout} layout, {where}, {launches}; median (best) of {a.steps} steps, best of {a.rounds} "
          f"rounds after a warm-up round")
    rows = []
    ways = (False, True) if a.compare else (a.per_shard,)
    for n in (int(x) for x in a.tensor_parallel.split(",")):
        devices = ",".join(a.tp_devices.split(",")[:n]) if a.tp_devices else ""
        for per_shard in ways if n > 1 else ways[:1]:
            row = {"tensor_parallel": n, "per_shard": per_shard,
                   **run(a.backend, layout, n, a.steps, a.rounds, a.num_blocks, devices, per_shard)}
            row["vs_n1"] = row["median_us"] / rows[0]["median_us"] if rows else 1.0
            rows.append(row)
            how = " (one launch a shard)" if per_shard else ""
            print(f"  N={n}: {row['median_us']:8.1f} us ({row['best_us']:.1f})  {row['copies_per_step']:.1f} "
                  f"copies/step  x{row['vs_n1']:.3f} of N={rows[0]['tensor_parallel']}{how}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"backend": a.backend, "layout": layout, "where": where, "launches": launches, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
