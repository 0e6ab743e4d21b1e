"""The tensor-parallel decode engine (``kvpool_client.integrations.tp_engine``) on a server with ``--tensor-parallel
N``: greedy and beam tokens identical to transformers' dense model and to the 1-shard ``DecodeEngine``, logits within
TOLERANCE of the dense model's, the KV each rank wrote (its shard, and ReadKV's whole tokens) equal to the 1-shard
engine's KV of the same heads, every block freed at the end. N = 2 and 4 over 4 KV heads, and N = 4 over 2 KV heads
(one head a rank, replicated twice).

Every rank sits on one device here (the server puts every shard on device 0 without ``--tp-devices``): the same
code a multi-GPU host runs, one rank a device. float32 on the CPU against a host-backend server (eager); float16 on
CUDA against a GPU server (one CUDA graph a batch bucket, all ranks in it; ``scripts/gpu_check.sh tp``)."""

from __future__ import annotations

import functools
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_client.integrations.engine import DecodeEngine  # noqa: E402
from kvpool_client.integrations.engine_beams import EngineBeams  # noqa: E402
from kvpool_client.integrations.hf_llama import DenseBeams  # noqa: E402
from kvpool_client.integrations.tp_engine import TPDecodeEngine  # noqa: E402
from kvpool_client.integrations.tp_llama import TPLlama  # noqa: E402
from tests.client.engine_cases import CASES, TOLERANCE, relative as _relative, search, tiny_llama  # noqa: E402
from tests.client.engine_cases import random_prompt as _prompt  # noqa: E402
from tests.client.greedy_ties import assert_same_until_tie  # noqa: E402

# The TP engine against the 1-shard engine, on the same tokens: float32 summation order; float16 the partial sums
# rounded to float16 before they are added.
TO_ONE_SHARD = {"float32": 1e-5, "float16": 1e-2}
STEPS = 8
_search = functools.partial(search, steps=STEPS)
ENGINE = {"max_batch": 8, "max_model_len": 128, "graph_sizes": [1, 2, 4, 8]}
SPLITS = [pytest.param(4, 2, id="4heads-2ranks"), pytest.param(4, 4, id="4heads-4ranks"),
          pytest.param(2, 4, id="2heads-4ranks-replicated")]


def server_args(device: str, dtype: str, kv_heads: int, block_size: int, tp: int) -> list[str]:
    return ["--backend", "gpu" if device == "cuda" else "host", "--pool-bytes", "8MiB", "--num-layers", "3",
            "--num-kv-heads", str(kv_heads), "--head-dim", "32", "--block-size", str(block_size), "--dtype", dtype,
            "--tensor-parallel", str(tp)]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("kv_heads,tp", SPLITS)
@pytest.mark.parametrize("width,block_size", [(1, 16), (3, 5)])
def test_tp_engine_matches_the_dense_model_and_one_shard(server_factory, device, dtype, kv_heads, tp, width,
                                                         block_size):
    """Greedy and beam width 3 (block size 5: beams share and copy partly filled blocks -- copy-on-write on every
    shard) on N shards: the dense model's tokens, logits within the bound on the same beams, and the 1-shard
    engine's tokens and logits."""
    model = tiny_llama(dtype, device, kv_heads)
    prompt = _prompt(21, width)
    sharded = server_factory(*server_args(device, dtype, kv_heads, block_size, tp))
    with KVPoolClient(sharded.address) as client:
        engine = TPDecodeEngine.on_pool(model, client, **ENGINE)
        assert engine.one_device and len(engine.shards) == tp and "one device" in engine.placement
        assert [r.kv_heads for r in engine.model.ranks] == [s.heads for s in client.describe_pool().shards]
        assert (device == "cuda") == bool(engine.graphs)  # one graph a bucket, every rank in it
        ours, decisions, our_logits = _search(EngineBeams(engine), prompt, width)
        engine.close()
        assert client.stats().num_blocks_used == 0  # every beam freed: forks and copy-on-write balanced
    one = server_factory(*server_args(device, dtype, kv_heads, block_size, 1))
    with KVPoolClient(one.address) as client:
        engine = DecodeEngine.on_pool(model, client, **ENGINE)
        single, _, single_logits = _search(EngineBeams(engine), prompt, width, decisions)
        engine.close()
    _, _, dense_logits = _search(DenseBeams(model), prompt, width, decisions)  # the same beams, dense
    dense, _, _ = _search(DenseBeams(model), prompt, width)  # the dense model's own choices
    rel, rel_one = _relative(our_logits, dense_logits), _relative(our_logits, single_logits)
    print(f"\n{device} {dtype} {kv_heads} heads / {tp} ranks, width {width}: max |logit diff| / max |logit| "
          f"{rel:.2e} to dense, {rel_one:.2e} to 1 shard")
    assert ours == dense and single == ours
    assert rel < TOLERANCE[dtype] and rel_one < TO_ONE_SHARD[dtype]


def _run(engine, prompts, follow=None):
    """Prefill ``prompts`` and decode STEPS greedy tokens -- or, given ``follow`` (another run's tokens), feed those
    (teacher-forced: the same path, so the KV is comparable); the sequences stay (their KV is checked). Returns the
    sequences, the argmax tokens and the logits ([prompts, STEPS, V] on the CPU)."""
    seqs = [engine.add_sequence() for _ in prompts]
    logits = [engine.prefill(seqs, prompts).float().cpu()]
    for i in range(STEPS - 1):
        fed = [o[i] for o in follow] if follow else logits[-1].argmax(-1).tolist()
        logits.append(engine.decode(seqs, fed).float().cpu())
    engine.check_errors()
    steps = torch.stack(logits, dim=1)
    return seqs, steps.argmax(-1).tolist(), steps


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("kv_heads,tp", SPLITS)
def test_each_rank_wrote_its_heads(server_factory, device, dtype, kv_heads, tp):
    """A batch of three prompts through ``generate``'s steps on N shards and on one: the same tokens (and those of
    transformers' ``generate``); the KV read back by ReadKV (whole tokens, joined from the ranks) and each rank's
    shard at the sequence's slots equal to the 1-shard engine's KV of that rank's heads (replicated ranks: the same
    head, each written by its own rank); every block freed at the end."""
    model = tiny_llama(dtype, device, kv_heads)
    model.generation_config.eos_token_id = None
    prompts = [_prompt(n, n).tolist() for n in (7, 21, 16)]
    kv, tokens, logits = [], [], []
    for n in (1, tp):
        server = server_factory(*server_args(device, dtype, kv_heads, 16, n))
        with KVPoolClient(server.address) as client:
            engine = TPDecodeEngine.on_pool(model, client, **ENGINE)  # N = 1: the TP engine over one shard
            seqs, out, steps = _run(engine, prompts, follow=tokens[0] if tokens else None)
            tokens.append(out)
            logits.append(steps)
            whole = [client.read_kv(s) for s in seqs]  # [n, L, 2, H, D] each, through the server
            kv.append(whole)
            if n > 1:
                for seq, read in zip(seqs, whole):
                    slots = torch.from_numpy(np.asarray(client.block_table(seq).slots(), dtype=np.int64))
                    for rank in engine.model.ranks:
                        idx = slots.to(rank.blocks.device)  # blocks [num_blocks, L, 2, bs, h, D]
                        mine = rank.blocks[idx // 16, :, :, idx % 16].cpu().numpy()  # [n, L, 2, h, D]
                        hs = rank.kv_heads
                        assert np.array_equal(mine, read[:, :, :, hs.start:hs.stop]), (rank.kv_heads, seq)
            held = sum(-(-(len(p) + STEPS - 1) // 16) for p in prompts) + 1  # and the scratch block
            assert client.stats().num_blocks_used == held
            engine.close()
            assert client.stats().num_blocks_used == 0 and client.stats().num_sequences == 0
    # the N-shard run followed the 1-shard run's tokens: its own choices equal them wherever they were decided
    rel_logits = float((logits[1] - logits[0]).abs().max()) / float(logits[0].abs().max())
    assert rel_logits <= TO_ONE_SHARD[dtype]
    compared = sum(assert_same_until_tie(ours, one, ref, max(rel_logits, 1e-6))
                   for ours, one, ref in zip(tokens[1], tokens[0], logits[0]))
    for p, got, ref in zip(prompts, tokens[0], logits[0]):
        hf = model.generate(torch.tensor([p], device=device), max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
        compared += assert_same_until_tie(got, hf[0, len(p):].tolist(), ref, TOLERANCE[dtype] / 4)
    assert compared >= 2 * STEPS  # not vacuous: a near tie stops one comparison, not the test's
    rel = 0.0
    for one, sharded in zip(*kv):  # not bit for bit: the KV of every layer after the first depends on the sums
        assert one.shape == sharded.shape
        one, sharded = one.astype(np.float32), sharded.astype(np.float32)
        rel = max(rel, float(np.abs(one - sharded).max()) / float(np.abs(one).max()))
    print(f"\n{device} {dtype} {kv_heads} heads / {tp} ranks: KV max |diff| / max |KV| {rel:.2e} to 1 shard")
    assert rel <= TO_ONE_SHARD[dtype]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kv_heads,tp", SPLITS)
def test_ranks_on_several_devices(server_factory, kv_heads, tp):
    """``--tp-devices``: rank r on GPU r % 2 (the partial sums moved to GPU 0, eager): greedy tokens of the dense
    model and of the 1-shard engine on one GPU, logits within the bounds."""
    model = tiny_llama("float16", "cuda", kv_heads)
    prompt = _prompt(21, 1)
    devices = ",".join(str(r % 2) for r in range(tp))
    server = server_factory(*server_args("cuda", "float16", kv_heads, 16, tp), "--tp-devices", devices)
    with KVPoolClient(server.address) as client:
        engine = TPDecodeEngine.on_pool(model, client, **ENGINE)
        assert not engine.one_device and not engine.graphs and engine.model.several_devices
        assert [d.index for d in engine.devices] == [r % 2 for r in range(tp)]
        ours, decisions, our_logits = _search(EngineBeams(engine), prompt, 1)
        engine.close()
        assert client.stats().num_blocks_used == 0
    one = server_factory(*server_args("cuda", "float16", kv_heads, 16, 1))
    with KVPoolClient(one.address) as client:
        engine = DecodeEngine.on_pool(model, client, **ENGINE)
        single, _, single_logits = _search(EngineBeams(engine), prompt, 1, decisions)
        engine.close()
    _, _, dense_logits = _search(DenseBeams(model), prompt, 1, decisions)
    dense, _, _ = _search(DenseBeams(model), prompt, 1)
    rel, rel_one = _relative(our_logits, dense_logits), _relative(our_logits, single_logits)
    print(f"\n2 GPUs, {kv_heads} heads / {tp} ranks: {rel:.2e} to dense, {rel_one:.2e} to 1 shard on one GPU")
    assert ours == dense and single == ours and rel < TOLERANCE["float16"] and rel_one < TO_ONE_SHARD["float16"]


def test_splits_the_model_cannot_take_are_refused():
    """A split whose q heads do not divide over the ranks, or a shard whose heads are not its q heads' KV heads:
    ValueError before anything runs."""
    model = tiny_llama("float32", "cpu", 2)
    shard = torch.zeros(4, 3, 2, 16, 1, 32)
    with pytest.raises(ValueError, match="attention heads"):
        TPLlama(model, [shard] * 16, [range(h // 8, h // 8 + 1) for h in range(16)])
    with pytest.raises(ValueError, match="KV heads"):
        TPLlama(model, [shard, shard], [range(1, 2), range(0, 1)])  # rank 0's q heads read head 0
    with pytest.raises(NotImplementedError):
        TPDecodeEngine.in_process(model, 16)
