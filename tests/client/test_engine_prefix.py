"""The decode engine on the shared prefix cache (docs/prefix-caching.md, "The engines"): a prefill over a prefix
another frontend cached gives a full prefill's logits and the same greedy tokens; a block another frontend filled
but has not sealed (its KV not written) is never a hit; the in-process baseline caches alike; on CUDA the append
that seals a prefill's blocks runs only after the prefill's writes. Real server processes (host backend on the CPU,
float32)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvpool_client import KVPoolClient  # noqa: E402
from kvpool_client.integrations.engine import DecodeEngine  # noqa: E402
from kvpool_client.integrations.tp_engine import TPDecodeEngine  # noqa: E402
from kvpool_client.integrations.engine_beams import EngineBeams  # noqa: E402
from tests.client.engine_cases import CASES, TOLERANCE, random_prompt, relative, search, tiny_llama  # noqa: E402

ENGINE = {"max_batch": 8, "max_model_len": 256, "graph_sizes": [1, 2, 4, 8]}
BS = 16


def server_args(device: str, dtype: str, *extra: str) -> list[str]:
    return ["--backend", "gpu" if device == "cuda" else "host", "--pool-bytes", "8MiB", "--num-layers", "3",
            "--num-kv-heads", "2", "--head-dim", "32", "--block-size", str(BS), "--dtype", dtype, *extra]


def _prompt(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed).tolist()


def _full_logits(model, prompt: list[int]) -> torch.Tensor:
    """The dense model's logits of the prompt's last token (nothing cached anywhere)."""
    with torch.no_grad():
        return model(torch.tensor([prompt], device=next(model.parameters()).device)).logits[0, -1].float().cpu()


def _dense_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of the dense model, each step a full forward over everything so far (no cache at all)."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(_full_logits(model, ids).argmax()))
    return ids[len(prompt):]


def _rel(ours: torch.Tensor, full: torch.Tensor) -> float:
    return float((ours.float().cpu() - full).abs().max()) / float(full.abs().max())


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("tp", [1, 2])
def test_a_prefill_over_a_cached_prefix_matches_a_full_prefill(server_factory, device, dtype, tp):
    """Frontend A generates from a prompt (its prompt blocks sealed after its prefill wrote them); frontend B,
    another client, gets the prompt's full blocks as a hit, computes only the suffix -- whose attention reads A's
    KV -- and gets the full prefill's logits (float32: within 1e-5 of the largest) and A's greedy tokens. ``tp`` 2:
    the tensor-parallel engine over a pool of two shards."""
    extra = ("--tensor-parallel", "2") if tp == 2 else ()
    server = server_factory(*server_args(device, dtype, *extra))
    model = tiny_llama(dtype, device)
    engine_class = TPDecodeEngine if tp == 2 else DecodeEngine
    prompt = _prompt(4 * BS + 7, 3)
    with KVPoolClient(server.address) as a, KVPoolClient(server.address) as b:
        writer = engine_class.on_pool(model, a, **ENGINE)
        first = writer.generate([prompt], 8)
        assert writer.cached_tokens == 0
        reader = engine_class.on_pool(model, b, **ENGINE)
        seq, cached = reader.add_prompt(prompt)
        assert cached == 4 * BS  # every full block of the prompt, from A's sequence (freed: its blocks stay cached)
        logits = reader.prefill([seq], [prompt[cached:]])[0]
        if device == "cuda" and tp == 1:  # the 7-token suffix replayed from a prefill graph
            assert [key for key, g in reader.prefill_graphs.graphs.items() if g is not None] == [(16, 256)]
        rel = _rel(logits, _full_logits(model, prompt))
        print(f"\n{device} {dtype} tp {tp}: cached {cached}/{len(prompt)}, max |logit diff| / max |logit| {rel:.2e}")
        assert rel < TOLERANCE[dtype]
        reader.free([seq])
        again = reader.generate([prompt], 8)
        assert again == first
        assert reader.cached_tokens == 2 * cached and reader.prompt_tokens == 2 * len(prompt)
        stats = b.stats()
        assert stats.prefix_hit_tokens == 2 * cached
        writer.close()
        reader.close()
    assert first == [_dense_greedy(model, prompt, 8)]


@pytest.mark.parametrize("device,dtype", CASES)
def test_a_block_filled_but_not_sealed_is_never_a_hit(server_factory, device, dtype):
    """Frontend A registers a prompt and appends all of it with its token ids, but writes no KV and makes no next
    append: its blocks are full, not sealed. The engine gets no hit and computes the prompt itself (right tokens).
    When A then seals its (never written) blocks, the hashes the engine sealed first stay cached: a third frontend
    reads the engine's KV, not A's."""
    server = server_factory(*server_args(device, dtype), unix=True)  # the shared-memory fast path too
    model = tiny_llama(dtype, device)
    prompt = _prompt(3 * BS + 5, 11)
    dense = [_dense_greedy(model, prompt, 6)]
    with KVPoolClient(server.address) as a, KVPoolClient(server.address) as b, KVPoolClient(server.address) as c:
        seq_a, cached_a = a.register_prompt(prompt)
        assert cached_a == 0
        a.append(seq_a, len(prompt), token_ids=prompt)  # filled; its KV never written
        engine = DecodeEngine.on_pool(model, b, **ENGINE)
        assert engine.generate([prompt], 6) == dense
        assert b.fast_path_open
        assert engine.cached_tokens == 0  # A's blocks were full, not sealed: no hit
        a.append(seq_a, 1, token_ids=[0])  # A seals its unwritten blocks now: their hashes are cached already
        third = DecodeEngine.on_pool(model, c, **ENGINE)
        seq, cached = third.add_prompt(prompt)
        assert cached == 3 * BS
        a_blocks = set(a.block_table(seq_a).block_ids[:3].tolist())
        assert not a_blocks & set(third.tables.table[third.tables.row_of[seq], :3].tolist())
        assert _rel(third.prefill([seq], [prompt[cached:]])[0], _full_logits(model, prompt)) < TOLERANCE[dtype]
        third.free([seq])
        for e in (engine, third):
            e.close()
        a.free([seq_a])


@pytest.mark.parametrize("device,dtype", CASES)
def test_the_in_process_baseline_caches_as_the_server(server_factory, device, dtype):
    """The same prompts (shared prefixes, an extra key, a pool small enough to evict) through the kvpool engine and
    the in-process one: the same cached tokens prompt by prompt, the same greedy tokens; the local cache's
    invariants hold after every batch."""
    server = server_factory(*server_args(device, dtype))
    model = tiny_llama(dtype, device)
    system = _prompt(2 * BS + 3, 5)
    batches = [[system + _prompt(n, n) for n in (9, 20)], [system + _prompt(9, 9)], [_prompt(40, 1)],
               [system + _prompt(20, 20)[:BS] + [1, 2, 3]], [system + _prompt(9, 9)]]
    keys = [b"", b"", b"", b"", b"lora:x"]
    with KVPoolClient(server.address) as client:
        pool = DecodeEngine.on_pool(model, client, **ENGINE)
        local = DecodeEngine.in_process(model, 96, BS, **ENGINE)
        for prompts, key in zip(batches, keys):
            before = (pool.cached_tokens, local.cached_tokens)
            assert pool.generate(prompts, 4, key) == local.generate(prompts, 4, key)
            assert pool.cached_tokens - before[0] == local.cached_tokens - before[1]
            local.control.check_invariants()
        assert local.cached_tokens == pool.cached_tokens > 0
        assert local.control.prefix.hit_tokens == client.stats().prefix_hit_tokens
        pool.close()
    small = DecodeEngine.in_process(model, 12, BS, **ENGINE)  # 11 blocks past the scratch one: evicts
    for i in range(6):
        small.generate([_prompt(4 * BS + 1, 100 + i % 3)], 2)
        small.control.check_invariants()
    assert small.cached_tokens > 0 and small.control.num_blocks_used() == 1


@pytest.mark.parametrize("device,dtype", CASES)
def test_a_prefix_restored_from_the_host_tier(server_factory, device, dtype):
    """A prompt's blocks evicted from a small pool into the host tier: the engine's register restores them before
    it replies (prefix_host_hit_tokens), and the prefill over them gives the full prefill's logits and tokens."""
    block_bytes = 3 * 2 * BS * 2 * 32 * (4 if dtype == "float32" else 2)
    server = server_factory("--backend", "gpu" if device == "cuda" else "host", "--pool-bytes", str(30 * block_bytes),
                            "--num-layers", "3", "--num-kv-heads", "2", "--head-dim", "32", "--block-size", str(BS),
                            "--dtype", dtype, "--host-tier-bytes", "4MiB", "--host-tier-writeback-blocks", "0")
    model = tiny_llama(dtype, device)
    prompt = _prompt(5 * BS + 3, 31)
    with KVPoolClient(server.address) as client:
        engine = DecodeEngine.on_pool(model, client, **ENGINE)
        first = engine.generate([prompt], 4)
        for i in range(6):  # 30 blocks in the pool: the prompt's are evicted, kept in the tier
            engine.generate([_prompt(5 * BS + 3, 40 + i)], 2)
        assert client.stats().prefix_host_hit_tokens == 0
        seq, cached = engine.add_prompt(prompt)
        assert cached == 5 * BS and client.stats().prefix_host_hit_tokens > 0
        assert _rel(engine.prefill([seq], [prompt[cached:]])[0], _full_logits(model, prompt)) < TOLERANCE[dtype]
        engine.free([seq])
        assert engine.generate([prompt], 4) == first
        engine.close()


@pytest.mark.parametrize("device,dtype", CASES)
def test_beam_search_over_a_cached_prompt(server_factory, device, dtype):
    """Beam search (width 3: forks, copy-on-write) from a prompt another client cached: the beams' tokens equal
    the same search over the uncached prompt, and the logits agree within the bound."""
    server = server_factory(*server_args(device, dtype))
    model = tiny_llama(dtype, device)
    prompt = torch.tensor(_prompt(3 * BS + 9, 13))
    runs = []
    for _ in range(2):
        with KVPoolClient(server.address) as client:
            engine = DecodeEngine.on_pool(model, client, **ENGINE)
            runs.append(search(EngineBeams(engine), prompt, 3, steps=6))
            runs[-1] += (engine.cached_tokens,)
            engine.close()
    (first, _, first_logits, cached_first), (second, _, second_logits, cached_second) = runs
    assert (cached_first, cached_second) == (0, 3 * BS)
    assert second == first
    assert relative(second_logits, first_logits) < TOLERANCE[dtype]


def test_the_salt_is_the_callers_tenant(server_factory, tmp_path):
    """With --auth-tokens the engine's prompts are hashed with the tenant its client's token names: another client
    of the same tenant hits, a client of another tenant computes the prompt itself (and gets the same tokens)."""
    from tests.security.tenant_helpers import write_tokens  # noqa: PLC0415

    tokens = write_tokens(tmp_path / "tokens.toml", tenants="[tenants.a]\nmay_attach = true\n"
                          "[tenants.b]\nmay_attach = true\n")
    server = server_factory(*server_args("cpu", "float32"), "--auth-tokens", str(tokens))
    model = tiny_llama("float32", "cpu")
    prompt = _prompt(3 * BS + 4, 21)
    cached, outputs = {}, {}
    for name, token in (("a", "tok-a"), ("a again", "tok-a"), ("b", "tok-b")):
        with KVPoolClient(server.address, token=token) as client:
            engine = DecodeEngine.on_pool(model, client, **ENGINE)
            outputs[name] = engine.generate([prompt], 4)
            cached[name] = engine.cached_tokens
            engine.close()
    assert cached == {"a": 0, "a again": 3 * BS, "b": 0}
    assert outputs["a"] == outputs["a again"] == outputs["b"]


def test_a_cached_run_that_breaks_the_protocol_is_refused_and_leaves_nothing():
    """A control path that reports more cached tokens than a prompt allows, or a run whose blocks lie outside the
    pool, is refused with ValueError; the sequence it registered is freed, the engine's tables hold
    nothing new. An empty prompt is refused before anything is registered."""
    model = tiny_llama("float32", "cpu")
    engine = DecodeEngine.in_process(model, 32, BS, **ENGINE)
    prompt = _prompt(3 * BS + 2, 8)
    engine.generate([prompt], 2)  # its 3 full blocks cached
    honest = engine.control

    class Liar:
        def __init__(self, cached=None, table=None):
            self.cached, self.table = cached, table

        def register_prompts(self, *args, **kwargs):
            run = honest.register_prompts(*args, **kwargs)[0]
            return [type(run)(run.seq_id, run.num_cached_tokens if self.cached is None else self.cached,
                              run.cached_block_ids if self.table is None else self.table)]

        def __getattr__(self, name):
            return getattr(honest, name)

    rows, held = len(engine.tables.row_of), len(honest.tables)
    for liar, match in ((Liar(cached=len(prompt)), "cached tokens"), (Liar(cached=BS + 1), "cached tokens"),
                        (Liar(table=np.array([0, 1, 99])), "pool of 32")):
        engine.control = liar
        with pytest.raises(ValueError, match=match):
            engine.add_prompt(prompt)
        assert len(engine.tables.row_of) == rows and len(honest.tables) == held  # freed, nowhere tracked
    engine.control = honest
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_prompt([])
    honest.check_invariants()
    assert honest.num_blocks_used() == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: a prefill's writes are asynchronous only there")
def test_the_append_that_seals_a_prefill_waits_for_its_writes(server_factory):
    """On CUDA ``prefill`` returns with its writes enqueued; the next append of the sequence seals its blocks. The
    control path sees the device idle at that append (``WriteFence``): the blocks are written before anyone can
    match them."""
    server = server_factory(*server_args("cuda", "float16"))
    model = tiny_llama("float16", "cuda")
    prompt = _prompt(240, 4)
    seen: list[bool] = []
    with KVPoolClient(server.address) as client:
        engine = DecodeEngine.on_pool(model, client, **ENGINE)
        inner = engine.control

        class Watch:
            def append(self, *args, **kwargs):
                seen.append(torch.cuda.current_stream().query())  # everything enqueued has run
                return inner.append(*args, **kwargs)

            def __getattr__(self, name):
                return getattr(inner, name)

        forward = engine.model.forward

        def slow_forward(*args, **kwargs):  # the device still busy (~0.1 s) when the forward returns
            out = forward(*args, **kwargs)
            torch.cuda._sleep(200_000_000)
            return out

        engine.control = Watch()
        engine.model.forward = slow_forward
        seq, cached = engine.add_prompt(prompt)
        assert cached == 0
        engine.prefill([seq], [prompt])  # no synchronization: its writes are queued on the device
        engine.reserve([seq], 1)  # seals the prompt's blocks
        assert seen == [True]
        engine.free([seq])
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="prefill graphs are captured on CUDA only")
def test_a_prefill_replayed_from_a_graph_matches_an_eager_one(server_factory):
    """Prompts of three size buckets, two of them in the same bucket one after the other (a replay refills every
    static input: nothing of the earlier prompt reaches the later one): the graph's logits are the eager
    prefill's and the dense model's, and the greedy tokens after them agree."""
    server = server_factory(*server_args("cuda", "float16"))
    model = tiny_llama("float16", "cuda")
    with KVPoolClient(server.address) as client:
        graphed = DecodeEngine.on_pool(model, client, **ENGINE)
        eager = DecodeEngine.on_pool(model, client, **ENGINE, prefill_graphs=False)
        assert eager.prefill_graphs is None
        for n in (5, 9, 37, 100):
            prompt = _prompt(n, n)
            full = _full_logits(model, prompt)
            outs = []
            for engine, key in ((graphed, b"graph"), (eager, b"eager")):
                seq, cached = engine.add_prompt(prompt, key)
                assert cached == 0
                logits = engine.prefill([seq], [prompt])[0]
                assert _rel(logits, full) < TOLERANCE["float16"]
                outs.append(logits.float().cpu())
                engine.free([seq])
            assert _rel(outs[0], outs[1]) < TOLERANCE["float16"]
        captured = sorted(key for key, g in graphed.prefill_graphs.graphs.items() if g is not None)
        assert captured == [(16, 256), (64, 256), (128, 256)]
        assert graphed.generate([_prompt(40, 1)], 6, b"g2") == eager.generate([_prompt(40, 1)], 6, b"e2")
        graphed.check_errors()
        graphed.close()
        eager.close()
