"""One vLLM engine in its own process, driven by the tests over stdin/stdout, one JSON object a line.

    python tests/vllm/engine_driver.py MODEL_DIR [--target unix:/x.sock] [--token-file F] [--cache-key K]

prints {"ready": true} once the engine is up, then answers each request line (each answer on a line of its own
after REPLY_MARK: vLLM logs to stdout too):

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8}
        -> {"outputs": [[ids...], ...], "num_cached": [n, ...], "metrics": {"vllm:external_prefix_cache_hits": n, ...}}
    {"op": "quit"}

Without --target the engine has no connector (the baseline). vLLM spawns its engine core, hence the __main__ guard.
The engine's own log goes to stderr (the tests keep it in a file).
"""

from __future__ import annotations

import argparse
import json
import sys

REPLY_MARK = "@@kvpool-test@@ "


def metrics(llm) -> dict[str, float]:
    wanted = ("vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries", "vllm:prefix_cache_hits",
              "vllm:prefix_cache_queries")
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            found[metric.name] = found.get(metric.name, 0) + float(getattr(metric, "value", 0))
    return found


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
    out = sys.stdout
    out.write(REPLY_MARK + json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        if request["op"] == "generate":
            params = SamplingParams(temperature=0, max_tokens=request.get("max_tokens", 8), detokenize=False,
                                    ignore_eos=True)
            results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params,
                                   use_tqdm=False)
            reply = {"outputs": [list(r.outputs[0].token_ids) for r in results],
                     "num_cached": [r.num_cached_tokens or 0 for r in results], "metrics": metrics(llm)}
        elif request["op"] == "reset_prefix_cache":
            reply = {"ok": bool(llm.reset_prefix_cache())}
        else:
            reply = {"error": f"unknown op {request['op']!r}"}
        out.write(REPLY_MARK + json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
