"""One vLLM engine in its own process, driven by the tests over stdin/stdout, one JSON object a line.

    python tests/vllm/engine_driver.py MODEL_DIR [--target unix:/x.sock] [--token-file F] [--cache-key K]

prints {"ready": true} once the engine is up, then answers each request line (each answer on a line of its own
after REPLY_MARK: vLLM logs to stdout too):

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8}
        -> {"outputs": [[ids...], ...], "num_cached": [n, ...], "metrics": {"vllm:external_prefix_cache_hits": n, ...}}
    {"op": "start", "prompts": [[ids...], ...], "max_tokens": 1500, "tokens": 24}
        -> {"steps": n}: the requests added and stepped until each has ``tokens`` output tokens, then left running
        (needs VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in this process steps only when asked, so what a
        test checks while they run cannot race their end)
    {"op": "finish"} -> as "generate", for the requests "start" left running: stepped to their end
    {"op": "quit"}

Without --target the engine has no connector (the baseline). vLLM spawns its engine core, hence the __main__ guard.
The engine's own log goes to stderr (the tests keep it in a file).
"""

from __future__ import annotations

import argparse
import json
import sys

REPLY_MARK = "@@kvpool-test@@ "
DRAIN_STEPS = 1000  # a finished request's store takes two steps (copy, then seal and free)


def metrics(llm) -> dict[str, float]:
    wanted = ("vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries", "vllm:prefix_cache_hits",
              "vllm:prefix_cache_queries")
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            found[metric.name] = found.get(metric.name, 0) + float(getattr(metric, "value", 0))
    return found


class HeldRequests:
    """Requests added with ``LLMEngine.add_request`` and stepped by hand: their latest outputs by request id."""

    def __init__(self, llm) -> None:
        if envs_multiprocessing():
            raise RuntimeError("'start' needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (an engine core stepped by hand)")
        self.engine = llm.llm_engine
        self.order: list[str] = []
        self.latest: dict[str, object] = {}

    def start(self, prompts, params, tokens: int) -> int:
        from vllm.inputs import TokensPrompt

        base = len(self.order)
        for i, ids in enumerate(prompts):
            self.order.append(f"held-{base + i}")
            self.engine.add_request(self.order[-1], TokensPrompt(prompt_token_ids=ids), params)
        steps = 0
        while any(self.produced(r) < tokens for r in self.order):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"the requests ended before {tokens} tokens: raise max_tokens")
            self.step()
            steps += 1
        return steps

    def produced(self, req_id: str) -> int:
        out = self.latest.get(req_id)
        return len(out.outputs[0].token_ids) if out is not None else 0

    def step(self) -> None:
        for out in self.engine.step():
            self.latest[out.request_id] = out

    def finish(self) -> list:
        while self.engine.has_unfinished_requests():
            self.step()
        done = [self.latest[r] for r in self.order]
        self.order, self.latest = [], {}
        return done


def drain(llm) -> None:
    """Step an in-process engine core while its scheduler still has work (a connector's stores and frees of
    finished requests), as vLLM's own engine-core process loop does: ``LLM.generate`` stops at the last output."""
    if envs_multiprocessing():
        return
    core = llm.llm_engine.engine_core.engine_core
    for _ in range(DRAIN_STEPS):
        if not core.scheduler.has_requests():
            return
        llm.llm_engine.step()
    raise RuntimeError(f"the engine core still has work after {DRAIN_STEPS} steps")


def envs_multiprocessing() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)


def answer(results, llm) -> dict:
    return {"outputs": [list(r.outputs[0].token_ids) for r in results],
            "num_cached": [r.num_cached_tokens or 0 for r in results], "metrics": metrics(llm)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--target")
    parser.add_argument("--token-file")
    parser.add_argument("--cache-key", default="")
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if args.target:
        extra = {"target": args.target, "retry_s": 0.5}
        if args.token_file:
            extra["token_file"] = args.token_file
        if args.cache_key:
            extra["cache_key"] = args.cache_key
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVPoolConnector", kv_connector_module_path="kvpool_client.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", block_size=32, enforce_eager=True,
              gpu_memory_utilization=0.15, kv_cache_memory_bytes=64 << 20, max_model_len=4096,
              enable_prefix_caching=not args.no_prefix_caching, disable_log_stats=False, seed=0, **kwargs)
    held: HeldRequests | None = None
    out = sys.stdout
    out.write(REPLY_MARK + json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        params = SamplingParams(temperature=0, max_tokens=request.get("max_tokens", 8), detokenize=False,
                                ignore_eos=True)
        if request["op"] == "generate":
            results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params,
                                   use_tqdm=False)
            drain(llm)
            reply = answer(results, llm)
        elif request["op"] == "start":
            try:
                held = held or HeldRequests(llm)
                reply = {"steps": held.start(request["prompts"], params, request["tokens"])}
            except RuntimeError as e:
                reply = {"error": str(e)}
        elif request["op"] == "finish":
            results = held.finish() if held else []
            drain(llm)
            reply = answer(results, llm)
        elif request["op"] == "reset_prefix_cache":
            reply = {"ok": bool(llm.reset_prefix_cache())}
        else:
            reply = {"error": f"unknown op {request['op']!r}"}
        out.write(REPLY_MARK + json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
