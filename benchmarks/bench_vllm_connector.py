"""The host cost of KVPoolConnector in vLLM's own scheduler, at 0% hits (issue 31).

vLLM's real ``Scheduler`` runs in this process with the connector's scheduler side on a real kvpool server (host
pool, unix socket); the model runner is replaced by an answer of one sampled token per request (and the workers'
``finished_sending`` for the stores the step's metadata carried), so what is timed is the scheduler and the
connector only. Every prompt is new (0% hits). The same steps run with and without the connector; reported: the
step time of each (p50, mean, and p50 of decode-only steps), the time spent inside the connector's methods per
step (p50, mean, by kind of step: timed around each call vLLM makes) and of it the lookup's (the step's one
call that carries the RegisterSequences of its new requests: a step record over the fast path), and kvpool round
trips -- one at most a step, a step record: the frees, stores and seals waiting and the step's lookups -- split
into steps that admit new requests, steps that carry work waiting (the last step's prompt stores, finished
requests' stores, seals, frees) and steps that only decode (the bar: 0 on those).

    .venv-vllm/bin/python benchmarks/bench_vllm_connector.py [--requests 64] [--prompt 512] [--max-tokens 64]
        [--batch 16] [--json out/bench_vllm_connector.json]

``--engines N``: instead, two real engines (tests/vllm/engine_driver.py: one with the connector, one without) run
the same N rounds of new prompts, alternating (``--one-at-a-time``: first one engine alone, then the other), and
the generation wall times are compared (throughput at 0% hits).

Needs vLLM (make test-vllm installs it into .venv-vllm) and a kvpool-server beside the interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_scheduler(model_dir: Path, target: str | None, num_blocks: int, batch: int):
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from tests.vllm.tiny_model import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=4096,
                        seed=0)
    kv_transfer = None
    if target:
        kv_transfer = KVTransferConfig(kv_connector="KVPoolConnector",
                                       kv_connector_module_path="kvpool_client.integrations.vllm",
                                       kv_role="kv_both", kv_connector_extra_config={"target": target})
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    config = VllmConfig(model_config=model, cache_config=cache,
                        scheduler_config=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192,
                                                         max_model_len=4096, is_encoder_decoder=False),
                        device_config=DeviceConfig("cpu"), kv_transfer_config=kv_transfer)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM,
                             dtype=torch.float32)
    kv_cache = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)], spec)])
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache,
                     structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE)


def run(scheduler, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Every request through vLLM's scheduler; one record per step: its seconds, whether it admitted new
    requests, and the connector's round trips in it."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(32, sha256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", p, params, None, block_hasher=hasher))
    connector = getattr(scheduler.connector, "scheduler", None)
    spent = [0.0]  # seconds inside the connector's scheduler-side methods, this step
    looked = [0.0]  # of which in its lookups (one RegisterSequences of the step's new requests)
    if scheduler.connector is not None:
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                     "request_finished", "update_connector_output", "has_pending_push_work"):
            setattr(scheduler.connector, name, _timed(getattr(scheduler.connector, name), spent))
        connector._register_many = _timed(connector._register_many, looked)
    steps = []
    while scheduler.has_requests():
        trips = connector.round_trips if connector else 0
        registers = connector.registers if connector else 0
        # work waiting for this step's call: the last step's prompt stores, finished requests', seals, frees
        stores = bool(connector and (connector._stores or getattr(connector, "_saves", ()) or connector._to_seal
                                     or connector._to_free))
        spent[0] = looked[0] = 0.0
        start = time.perf_counter()
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        meta = out.kv_connector_metadata
        sending = {s.req_id for s in getattr(meta, "stores", ())}
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[[7] for _ in ids],
                                   kv_connector_output=KVConnectorOutput(finished_sending=sending or None))
        scheduler.update_from_output(out, runner)
        steps.append({"s": time.perf_counter() - start, "connector_s": spent[0], "lookup_s": looked[0],
                      "new": bool(out.scheduled_new_reqs),
                      "stores": stores, "copies_before_forward": bool(getattr(meta, "stores", None) or
                                                                     getattr(meta, "saves", None)),
                      "sync_loads": bool(out.has_sync_kv_loads), "loaded_blocks": sum(len(c.pool_blocks) for c in getattr(meta, "loads", ())),
                      "trips": (connector.round_trips - trips) if connector else 0,
                      "registers": (connector.registers - registers) if connector else 0})
    return steps


def _timed(method, spent: list[float]):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    return timed


def summary(steps: list[dict]) -> dict:
    times = [s["s"] * 1e6 for s in steps]
    kinds = {"new_request_steps": [s for s in steps if s["new"]],
             "storing_steps": [s for s in steps if s["stores"] and not s["new"]],
             "decode_only_steps": [s for s in steps if not s["new"] and not s["stores"]]}
    connector_us = {kind: {"p50": statistics.median([s["connector_s"] * 1e6 for s in group]) if group else 0.0,
                           "mean": statistics.fmean([s["connector_s"] * 1e6 for s in group]) if group else 0.0}
                    for kind, group in kinds.items()}
    new = [s for s in steps if s["new"]]
    lookup_us = [s["lookup_s"] * 1e6 for s in new]
    stores = [s for s in steps if s["stores"] and not s["new"]]
    decode = [s for s in steps if not s["new"] and not s["stores"]]
    decode_us = [s["s"] * 1e6 for s in decode]
    return {"steps": len(steps), "p50_us": statistics.median(times), "mean_us": statistics.fmean(times),
            "connector_us": connector_us,
            "lookup_us_on_new_request_steps": {"p50": statistics.median(lookup_us) if lookup_us else 0.0,
                                               "mean": statistics.fmean(lookup_us) if lookup_us else 0.0},
            "decode_only_p50_us": statistics.median(decode_us) if decode_us else 0.0,
            "steps_with_new_requests": len(new), "round_trips_on_new_request_steps": sum(s["trips"] for s in new),
            "max_round_trips_on_a_new_request_step": max((s["trips"] for s in new), default=0),
            "max_round_trips_in_a_step": max((s["trips"] for s in steps), default=0),
            "round_trips": sum(s["trips"] for s in steps),
            "connector_ms_in_all": sum(s["connector_s"] for s in steps) * 1e3,
            "max_registers_in_a_step": max((s["registers"] for s in steps), default=0),
            "registers": sum(s["registers"] for s in steps),
            "steps_storing_finished_requests": len(stores),
            "round_trips_on_storing_steps": sum(s["trips"] for s in stores),
            "decode_only_steps": len(decode), "round_trips_on_decode_only_steps": sum(s["trips"] for s in decode)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json")
    parser.add_argument("--engines", type=int, default=0, help="rounds of the two-engine throughput comparison")
    parser.add_argument("--before", help="with --engines: a third engine with the connector of this checkout "
                        "(its client/ directory), for a before/after comparison in one run")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="with --engines: run the two engines one after the other, never both alive")
    args = parser.parse_args()
    if args.engines:
        return engines(args)

    from tests.conftest import server_command, wait_serving
    from tests.vllm.tiny_model import server_layout_args, write_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = write_tiny_llama(work / "model")
    sock = str(work / "kvpool.sock")
    server = subprocess.Popen(server_command() + ["--backend", "host", "--num-blocks", "8192", "--unix-socket", sock,
                                                  "--address", "", *server_layout_args()],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_serving(f"unix:{sock}", server)
        prompts = [[(i * 7919 + j * 31) % 500 + 3 for j in range(args.prompt)] for i in range(args.requests)]
        results = {}
        for name, target in (("without", None), ("with", f"unix:{sock}"), ("without_again", None)):
            scheduler = make_scheduler(model, target, 4096, args.batch)
            if scheduler.connector is not None:  # its session and fast-path channel opened before the clock
                client = scheduler.connector.scheduler.link.client
                client.free(client.register())
            # a distinct prompt set per run: 0% hits in kvpool and in vLLM's own cache
            salt = len(results) * 100_000
            results[name] = summary(run(scheduler, [[t + salt % 3 for t in p] for p in prompts], args.max_tokens))
            if scheduler.connector is not None:
                scheduler.connector.shutdown()
        base = statistics.fmean([results["without"]["mean_us"], results["without_again"]["mean_us"]])
        results["connector_mean_us_per_step"] = results["with"]["mean_us"] - base
        results["connector_share"] = results["connector_mean_us_per_step"] / base
        results["args"] = vars(args)
        text = json.dumps(results, indent=2)
        print(text)
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            Path(args.json).write_text(text + "\n")
    finally:
        server.terminate()
        server.wait(20)


def engines(args: argparse.Namespace) -> None:
    """The same new prompts through an engine with the connector and one without (alternating, both alive; or
    ``--one-at-a-time``: each alone); the generation wall times."""
    from tests.vllm.harness import Engine, KVPoolServer
    from tests.vllm.tiny_model import write_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-engines-"))
    model = write_tiny_llama(work / "model")
    server = KVPoolServer(work, str(work / "kvpool.sock"), num_blocks=8192)
    server.start()
    extra = {"with": ("--target", server.address, "--token-file", str(server.token_files["alpha"])), "without": ()}
    envs: dict[str, dict[str, str]] = {}
    if args.before:  # a third engine: the connector of another checkout (its client/), the same server
        extra = {"before": ("--target", server.address, "--token-file", str(server.token_files["beta"])), **extra}
        # another tenant: it shares no block with "with" (both see 0% hits)
        envs["before"] = {"PYTHONPATH": f"{Path(args.before).resolve() / 'client'}{os.pathsep}{ROOT}"}
    times: dict[str, list[float]] = {name: [] for name in extra}
    # new prompts every round: 0% hits in kvpool and in vLLM's own cache
    rounds = [[[rng.randrange(3, 511) for _ in range(args.prompt)] for _ in range(args.requests)]
              for rng in (random.Random(r) for r in range(args.engines))]

    def one_round(engine: Engine, name: str, prompts: list[list[int]]) -> None:
        start = time.perf_counter()
        out = engine.generate(prompts, args.max_tokens)
        times[name].append(time.perf_counter() - start)
        assert not any(out["num_cached"]), "0% hits expected"

    try:
        if args.one_at_a_time:
            for name in extra:
                engine = Engine(name, model, work, *extra[name], env=envs.get(name))
                try:
                    engine.wait_ready()  # the start-up is not timed
                    for prompts in rounds:
                        one_round(engine, name, prompts)
                finally:
                    engine.stop()
        else:
            both = {name: Engine(name, model, work, *extra[name], env=envs.get(name)) for name in extra}
            try:
                for engine in both.values():
                    engine.wait_ready()
                for r, prompts in enumerate(rounds):
                    for name in list(extra)[:: 1 if r % 2 else -1]:
                        one_round(both[name], name, prompts)
            finally:
                for engine in both.values():
                    engine.stop()
    finally:
        server.stop()
    tokens = args.requests * (args.prompt + args.max_tokens)
    result: dict = {name: {"seconds": t, "median_s": statistics.median(t),
                           "tokens_per_s": tokens / statistics.median(t)} for name, t in times.items()}
    for name in extra:
        if name != "without":
            result[f"{name}_over_without"] = result[name]["median_s"] / result["without"]["median_s"]
    result["args"] = vars(args)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
