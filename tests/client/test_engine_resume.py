"""Resume after a crash: an engine process SIGKILLed mid-generation; a new engine process sending the same prompts
gets >= 99% of their full prompt blocks from the pool -- the dead session's sequences are freed by the server,
the prompt blocks they sealed stay cached -- and generates the tokens a full computation gives."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_client.integrations.engine import DecodeEngine  # noqa: E402
from tests.client.engine_cases import CASES, random_prompt, tiny_llama  # noqa: E402

BS = 16
ENGINE = {"max_batch": 8, "max_model_len": 512, "graph_sizes": [8]}
PROMPT_LENS = [5 * BS + 3, 7 * BS + 9, 3 * BS + 1, 9 * BS + 15, 4 * BS + 8, 6 * BS + 2, 8 * BS + 11, 2 * BS + 5]


def _prompts() -> list[list[int]]:
    return [random_prompt(n, 500 + i).tolist() for i, n in enumerate(PROMPT_LENS)]


def _generate_forever(address: str, device: str, dtype: str) -> None:
    """The engine that crashes: all prompts in one batch, far more steps than the parent lets it run."""
    with KVPoolClient(address) as client:
        engine = DecodeEngine.on_pool(tiny_llama(dtype, device), client, helpers="eager", **ENGINE)
        engine.generate(_prompts(), 512 - max(PROMPT_LENS) - 1)


def _resume(address: str, device: str, dtype: str, results) -> None:
    """The new engine process: the same prompts; how many tokens each got from the pool, and its tokens."""
    try:
        with KVPoolClient(address) as client:
            engine = DecodeEngine.on_pool(tiny_llama(dtype, device), client, helpers="eager", **ENGINE)
            tokens = engine.generate(_prompts(), 4)
            results.put({"cached": engine.cached_tokens, "tokens": tokens})
            engine.close()
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which fails the test)
        results.put({"error": repr(e)})


@pytest.mark.parametrize("device,dtype", CASES)
def test_a_new_engine_resumes_from_a_killed_ones_prompt_blocks(server_factory, device, dtype):
    server = server_factory("--backend", "gpu" if device == "cuda" else "host", "--pool-bytes", "16MiB",
                            "--num-layers", "3", "--num-kv-heads", "2", "--head-dim", "32", "--block-size", str(BS),
                            "--dtype", dtype, "--session-ttl-ms", "500")
    ctx = mp.get_context("spawn")
    crashing = ctx.Process(target=_generate_forever, args=(server.address, device, dtype))
    crashing.start()
    prompt_tokens = sum(PROMPT_LENS)
    with KVPoolClient(server.address, session=False) as watcher:
        deadline = time.monotonic() + 300
        while watcher.stats().num_tokens < prompt_tokens + 8 * len(PROMPT_LENS):  # prefilled, 8 steps decoded
            assert crashing.is_alive() and time.monotonic() < deadline, "the engine did not get to decoding"
            time.sleep(0.05)
        os.kill(crashing.pid, signal.SIGKILL)  # mid-generation
        crashing.join(timeout=30)
        assert crashing.exitcode == -signal.SIGKILL
        while watcher.stats().num_sequences:  # the dead session's lease ends: its sequences are freed
            assert time.monotonic() < deadline, "the dead session's sequences were never freed"
            time.sleep(0.05)
        assert watcher.stats().num_blocks_used == 0
        results = ctx.Queue()
        resumed = ctx.Process(target=_resume, args=(server.address, device, dtype, results))
        resumed.start()
        report = results.get(timeout=300)
        resumed.join(timeout=60)
        assert "error" not in report, report
    full_blocks = sum(n // BS for n in PROMPT_LENS)
    print(f"\n{device}: {report['cached'] // BS}/{full_blocks} full prompt blocks from the pool after the crash")
    assert report["cached"] // BS >= 0.99 * full_blocks
    reference = DecodeEngine.in_process(tiny_llama(dtype, device), 128, BS, helpers="eager", **ENGINE)  # like theirs
    assert report["tokens"] == reference.generate(_prompts(), 4)
