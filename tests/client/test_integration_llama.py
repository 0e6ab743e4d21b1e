"""A real model whose KV cache is kvpool: HF LlamaForCausalLM (small random config), greedy and beam search with
K/V written into the pool per layer and attention read from it, against the unmodified model's own attention.

Runs where PyTorch and transformers are installed (``kvpool[torch]``): on the host pool with float32 on the
CPU, and on the GPU pool with float16/bfloat16 when CUDA is there (``scripts/gpu_check.sh datapath``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_client.integrations.hf_llama import DenseBeams, KVPoolLlama, PagedBeams, beam_search  # noqa: E402

CASES = [pytest.param("cpu", "float32", id="cpu-float32")]
if torch.cuda.is_available():
    CASES += [pytest.param("cuda", "float16", id="cuda-float16"), pytest.param("cuda", "bfloat16", id="cuda-bf16")]
# max |logit diff| / max |logit| over a step, teacher-forced (the reference decodes the same beams)
TOLERANCE = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}


def tiny_llama(dtype: str, device: str, seed: int = 0):
    config = transformers.LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
                                      attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).to(device).eval()
    return model


def _server_args(device: str, dtype: str, block_size: int, kv_layout: str = "block-major") -> list[str]:
    return ["--backend", "gpu" if device == "cuda" else "host", "--pool-bytes", "8MiB", "--num-layers", "3",
            "--num-kv-heads", "2", "--head-dim", "32", "--block-size", str(block_size), "--dtype", dtype,
            "--kv-layout", kv_layout]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("width,kv_layout", [(1, "block-major"), (3, "block-major"), (3, "layer-major")])
def test_logits_and_tokens_match_the_dense_model(server_factory, device, dtype, width, kv_layout):
    block_size = 16 if width == 1 else 5  # an odd block size: the decode kernel's tile spans blocks
    server = server_factory(*_server_args(device, dtype, block_size, kv_layout))
    model = tiny_llama(dtype, device)
    prompt = torch.randint(0, 384, (21,), generator=torch.Generator().manual_seed(width))
    steps = int(os.environ.get("KVPOOL_LLAMA_STEPS", "12"))
    ours: dict[int, torch.Tensor] = {}
    theirs: dict[int, torch.Tensor] = {}
    free: dict[int, torch.Tensor] = {}
    with KVPoolClient(server.address) as client:
        runner = KVPoolLlama(model, client)
        paged, decisions = beam_search(PagedBeams(runner), prompt, width, steps,
                                       lambda s, lg, d=ours: d.__setitem__(s, lg.float().cpu()))
        beam_search(DenseBeams(model), prompt, width, steps, lambda s, lg: theirs.__setitem__(s, lg.float().cpu()),
                    follow=decisions)  # the same beams through the unmodified model
        dense, _ = beam_search(DenseBeams(model), prompt, width, steps,
                               lambda s, lg: free.__setitem__(s, lg.float().cpu()))  # its own choices
        assert client.stats().num_blocks_used == 0  # every beam freed: forks and copy-on-write balanced
    diffs = [float((ours[s] - theirs[s]).abs().max()) for s in range(steps)]
    scale = max(float(theirs[s].abs().max()) for s in range(steps))
    print(f"\n{device} {dtype} width {width}: max |logit| {scale:.1f}, max |logit diff| per step "
          f"{[format(d, '.2e') for d in diffs]}; tokens identical to the dense model's own search: {paged == dense}")
    assert max(diffs) / scale < TOLERANCE[dtype]
    if dtype != "bfloat16":  # bf16 rounding (8 bits of mantissa) can flip a near-tie; reported above
        assert paged == dense
    if width == 1:  # greedy: also transformers' own generate() with its dense KV cache
        model.generation_config.eos_token_id = None
        generated = model.generate(prompt[None].to(device), max_new_tokens=steps, do_sample=False, num_beams=1,
                                   output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        same = generated.sequences[0, len(prompt):].tolist() == paged[0]
        hf_diffs = [float((ours[s][0] - generated.logits[s][0].float().cpu()).abs().max()) for s in range(steps)]
        print(f"  vs generate() with DynamicCache: tokens identical {same}, max |logit diff| {max(hf_diffs):.2e}")
        if dtype != "bfloat16":
            assert same and max(hf_diffs) / scale < TOLERANCE[dtype]


# --- several frontend processes, each its own model instance, sharing one server ----------------------------------

def _frontend(address: str, index: int, dtype: str, steps: int, barrier, results) -> None:
    """One frontend process: its own model (seed ``index``), its own client and session; greedy and beam width 3
    with KV in the shared pool, each checked against its own dense reference. One more sequence is left registered
    on purpose: closing the client ends the session, and the server frees it."""
    model = tiny_llama(dtype, "cuda", seed=index)
    report: dict = {"index": index}
    try:
        with KVPoolClient(address) as client:
            runner = KVPoolLlama(model, client)
            leftover = client.register()
            prompt = torch.randint(0, 384, (13 + index,), generator=torch.Generator().manual_seed(100 + index))
            runner.forward([leftover], prompt[None])
            barrier.wait(timeout=300)  # every process decodes at the same time
            report["start"] = time.time()
            for width in (1, 3):
                ours: dict[int, torch.Tensor] = {}
                theirs: dict[int, torch.Tensor] = {}
                paged, decisions = beam_search(PagedBeams(runner), prompt, width, steps,
                                               lambda s, lg, d=ours: d.__setitem__(s, lg.float().cpu()))
                beam_search(DenseBeams(model), prompt, width, steps,
                            lambda s, lg, d=theirs: d.__setitem__(s, lg.float().cpu()), follow=decisions)
                dense, _ = beam_search(DenseBeams(model), prompt, width, steps)
                scale = max(float(theirs[s].abs().max()) for s in range(steps))
                report[width] = (max(float((ours[s] - theirs[s]).abs().max()) for s in range(steps)) / scale,
                                 paged == dense)
            report["end"] = time.time()
            report["session"] = client.session_id
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which fails the test)
        report["error"] = repr(e)
    results.put(report)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh datapath2)")
@pytest.mark.parametrize("num_processes", [3])
def test_frontend_processes_share_one_server(server_factory, num_processes):
    dtype, steps = "float16", int(os.environ.get("KVPOOL_LLAMA_STEPS", "12"))
    server = server_factory(*_server_args("cuda", dtype, 5))  # block size 5: beams copy shared last blocks
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(num_processes), ctx.Queue()
    procs = [ctx.Process(target=_frontend, args=(server.address, i, dtype, steps, barrier, results))
             for i in range(num_processes)]
    for p in procs:
        p.start()
    reports = sorted((results.get(timeout=600) for _ in procs), key=lambda r: r["index"])
    for p in procs:
        p.join(timeout=60)
    for r in reports:
        print(f"\nprocess {r['index']} (session {r.get('session')}): greedy max rel logit diff "
              f"{r.get(1, (float('nan'),))[0]:.1e}, beam-3 {r.get(3, (float('nan'),))[0]:.1e}, tokens identical "
              f"{r.get(1, (0, None))[1]}/{r.get(3, (0, None))[1]}; {r.get('error', '')}")
    assert all("error" not in r for r in reports) and all(p.exitcode == 0 for p in procs)
    assert len({r["session"] for r in reports}) == num_processes  # each process its own session
    assert max(r["start"] for r in reports) < min(r["end"] for r in reports)  # the decodes overlapped
    for r in reports:
        for width in (1, 3):
            rel, same = r[width]
            assert rel < TOLERANCE[dtype] and same, (r["index"], width)
    with KVPoolClient(server.address) as client:
        stats = client.stats()
        assert stats.num_blocks_used == 0 and stats.num_sequences == 0, stats  # the leftovers went with the sessions
        assert client.check_invariants().ok
