"""Where an engine's time goes, with and without KVPoolConnector: every thread of every vLLM process sampled.

    .venv-vllm/bin/python benchmarks/profile_vllm_engine.py [--rounds 5] [--json out/profile_vllm_engine.json]

Runs bench_vllm_connector.py's throughput comparison (``--engines N --one-at-a-time``: the engine with the
connector alone, then the one without, the same new prompts) with a sampler in each engine's processes (a
``sitecustomize`` on their PYTHONPATH): every 2 ms a daemon thread records each thread's Python stack. Reported,
per engine and process: the samples of its main thread, and the share of them inside each of ``MARKS`` (the
connector's methods, vLLM's forward pass, vLLM's own wait for the worker). A sample is wall time, not CPU: a
thread waiting in C shows where it waits.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SAMPLE_EVERY_S = 0.002
MARKS = ("get_num_new_matched_tokens", "build_connector_meta", "request_finished", "update_connector_output",
         "start_load_kv", "wait_for_save", "execute_model", "_model_forward", "acquire_read", "schedule")
SAMPLER = '''
import os
if os.environ.get("KVP_SAMPLE_DIR"):
    import collections, json, sys, threading, time
    def _sample(out=os.environ["KVP_SAMPLE_DIR"], every=SAMPLE_EVERY_S):
        counts, me, last = collections.Counter(), threading.get_ident(), time.monotonic()
        while True:
            time.sleep(every)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                stack = []
                while frame is not None and len(stack) < 60 and ident != me:
                    stack.append(frame.f_code.co_name)
                    frame = frame.f_back
                if stack:
                    counts[(names.get(ident, "?"), *stack)] += 1
            if time.monotonic() - last > 1:
                last = time.monotonic()
                with open(f"{out}/{os.getpid()}.json.tmp", "w") as fh:
                    json.dump([[list(k), v] for k, v in counts.most_common(5000)], fh)
                os.replace(f"{out}/{os.getpid()}.json.tmp", f"{out}/{os.getpid()}.json")
    threading.Thread(target=_sample, name="kvp-sampler", daemon=True).start()
'''.replace("SAMPLE_EVERY_S", repr(SAMPLE_EVERY_S))


def shares(path: Path) -> dict:
    main = [(k[1:], v) for k, v in json.loads(path.read_text()) if k[0] == "MainThread"]
    total = sum(v for _, v in main)
    inside = collections.Counter({m: sum(v for stack, v in main if m in stack) for m in MARKS})
    return {"main_thread_samples": total, **{m: round(n / total, 4) for m, n in inside.items() if n}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    import benchmarks.bench_vllm_connector as bench
    import tests.vllm.harness as harness

    work = Path(tempfile.mkdtemp(prefix="profile-vllm-"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SAMPLER)
    start = harness.Engine.__init__

    def sampled(self, name, model, workdir, *rest, env=None):
        env = dict(env or {}, KVP_SAMPLE_DIR=str(work / name))
        env["PYTHONPATH"] = f"{work / 'site'}{os.pathsep}{env.get('PYTHONPATH', str(harness.ROOT))}"
        os.makedirs(env["KVP_SAMPLE_DIR"], exist_ok=True)
        start(self, name, model, workdir, *rest, env=env)

    harness.Engine.__init__ = sampled
    sys.argv = [sys.argv[0], "--engines", str(args.rounds), "--one-at-a-time", "--requests", "32", "--prompt", "512",
                "--max-tokens", "32", "--json", str(work / "rounds.json")]
    bench.main()
    result = {"rounds": json.loads((work / "rounds.json").read_text()),
              "processes": {name: {p.stem: shares(p) for p in sorted((work / name).glob("*.json"))}
                            for name in ("with", "without")}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
