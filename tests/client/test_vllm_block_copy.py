"""The vLLM connector's block copy (``integrations/vllm/block_copy.py``) without a GPU: the Triton kernel run by
Triton's interpreter on CPU tensors, byte for byte against the PyTorch path (vLLM's NHD and HND CUDA layouts and
the CPU backend's, fp16 and bf16, both directions, a masked tile; every kernel variant of ``CopyConfig``: tiles,
blocks a program, words, eviction hints); its PTX for sm_90 compiled here (16-byte
loads and stores); the refusals that send a copy to the PyTorch path; the block-id checks; and the worker's failure
semantics around it (a failed load is a recompute, a failed store is reported). vLLM is stubbed where it is not
installed (``benchmarks/bench_vllm_gpu.py``'s stub); the GPU run itself is that benchmark.
"""

from __future__ import annotations

import re
import sys

import pytest

torch = pytest.importorskip("torch")

try:
    import triton
except ImportError:
    triton = None
needs_triton = pytest.mark.skipif(triton is None, reason="Triton is not installed here")

L, N, P = 3, 9, 11  # layers, vLLM blocks, pool blocks


@pytest.fixture(scope="module")
def vllm_pkg():
    """The connector's modules, with vLLM stubbed when it is absent; sys.modules restored after (tests/vllm skip
    on a missing vLLM, a stub left behind would make them run)."""
    before = set(sys.modules)
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
    except ImportError:
        from benchmarks.bench_vllm_gpu import stub_vllm

        stub_vllm()
    from kvpool_client.integrations.vllm import block_copy, metadata, settings, worker

    yield block_copy, worker, metadata, settings
    for name in set(sys.modules) - before:
        del sys.modules[name]


@pytest.fixture
def interpreted(vllm_pkg, monkeypatch):
    """block_copy with its kernel run by Triton's interpreter (real CPU addresses: the layer offset table works)."""
    from triton.runtime.interpreter import InterpretedFunction

    bc = vllm_pkg[0]
    monkeypatch.setattr(bc, "_block_copy_kernel", InterpretedFunction(bc._block_copy_kernel.fn))
    return bc


def make_layers(layout: str, dtype, b: int, h: int, d: int, seed: int = 0):
    """Per-layer caches in vLLM 0.32's logical [N, H, B, 2D], K/V views as ``worker.kv_views`` makes them."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(L):
        if layout == "NHD":  # memory [N, B, H, 2D]
            cache = torch.randn(N, b, h, 2 * d, generator=gen).to(dtype).permute(0, 2, 1, 3)
        else:  # HND (memory = the logical shape) and the CPU backend's
            cache = torch.randn(N, h, b, 2 * d, generator=gen).to(dtype)
        if layout == "CPU":  # a block's head: its K tokens, then its V tokens
            kv = cache.view(N, h, 2, b, d)
            layers.append((kv[:, :, 0].permute(0, 2, 1, 3), kv[:, :, 1].permute(0, 2, 1, 3)))
        else:  # the CUDA backends: K = [..., :D], V = [..., D:]
            layers.append((cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2)))
    return layers


def bits(t):
    return t.contiguous().view(torch.int16)


def snapshot(layers):
    return [(k.clone(), v.clone()) for k, v in layers]


def check_both_directions(bc, layout, dt, shape, config=None):
    """Store then load through the kernel, every byte against the PyTorch path; returns the copier of the load."""
    b, h, d = shape
    kw = {} if config is None else {"config": config}
    pool_ids, vllm_ids = [7, 0, 10, 3], [5, 1, 8, 2]  # neither side in order
    pool0 = torch.randn(P, L, 2, b, h, d, generator=torch.Generator().manual_seed(1)).to(dt)

    layers = make_layers(layout, dt, b, h, d)
    copier = bc.BlockCopier(layers, kernel_on_cpu=True, **kw)
    pool, ref = pool0.clone(), pool0.clone()
    copier.copy(pool, pool_ids, vllm_ids, into_vllm=False)
    assert copier.path == "triton"
    bc._torch_copy(layers, ref, pool_ids, vllm_ids, False)
    assert torch.equal(bits(pool), bits(ref))  # every byte: the stored blocks and the untouched ones
    assert not torch.equal(bits(pool), bits(pool0))

    ref_layers = make_layers(layout, dt, b, h, d, seed=2)
    layers = make_layers(layout, dt, b, h, d, seed=2)
    copier = bc.BlockCopier(layers, kernel_on_cpu=True, **kw)
    copier.copy(pool0, pool_ids, vllm_ids, into_vllm=True)
    assert copier.path == "triton"
    bc._torch_copy(ref_layers, pool0, pool_ids, vllm_ids, True)
    for (k, v), (rk, rv) in zip(layers, ref_layers, strict=True):
        assert torch.equal(bits(k), bits(rk)) and torch.equal(bits(v), bits(rv))
    assert torch.equal(bits(layers[2][1][8]), bits(pool0[10, 2, 1]))  # one block by hand: pool 10 -> vLLM 8, V
    return copier


@needs_triton
@pytest.mark.parametrize("layout", ["NHD", "HND", "CPU"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(4, 2, 16), (3, 2, 24)], ids=["even", "masked"])  # block size, heads, head
def test_kernel_matches_the_torch_path_byte_for_byte(interpreted, layout, dtype, shape):
    check_both_directions(interpreted, layout, getattr(torch, dtype), shape)


# (config fields, the word the even shape is moved as): several tile steps a block (64-128 B tiles), a program
# whose last pairs are past the copy's (3 or 8 a program, 4 pairs), 4- and 8-byte words, eviction hints
VARIANTS = [(dict(tile_bytes=64, blocks_per_program=3, word_bytes=8, evict_first=True), 8),
            (dict(tile_bytes=128, num_warps=8, blocks_per_program=4, word_bytes=4), 4),
            (dict(blocks_per_program=8, word_bytes=8), 8),
            (dict(tile_bytes=32, blocks_per_program=2, word_bytes=2, evict_first=True), 2)]


@needs_triton
@pytest.mark.parametrize("layout", ["NHD", "HND", "CPU"])
@pytest.mark.parametrize("shape", [(4, 2, 16), (3, 2, 24), (2, 1, 6)], ids=["even", "masked", "odd"])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_every_kernel_variant_matches_the_torch_path(interpreted, layout, shape, variant):
    fields, word = VARIANTS[variant]
    copier = check_both_directions(interpreted, layout, torch.float16, shape, interpreted.CopyConfig(**fields))
    # every address and stride of the even and masked shapes divides 8 bytes; the odd one's head is 12 bytes
    assert copier.word == (min(word, 4) if shape == (2, 1, 6) else word)


@needs_triton
@pytest.mark.parametrize("word,bpp,evict", [(2, 1, ""), (8, 4, "evict_first"), (4, 2, "")])
def test_kernel_compiles_to_16_byte_accesses_for_sm90(vllm_pkg, word, bpp, evict):
    """The PTX of both directions for both CUDA layouts (Llama-3-8B's block, moved as 2-, 4- or 8-byte words, one
    or several blocks a program): 16-byte vector loads and stores only (the layer offsets' alignment hint; without
    it vLLM's side is read 2 bytes at a time), the loads marked evict-first where asked."""
    from triton.backends.compiler import GPUTarget

    kernel = vllm_pkg[0]._block_copy_kernel
    if not isinstance(kernel, triton.runtime.JITFunction):
        pytest.skip("TRITON_INTERPRET is set: the kernel is not compiled")
    names = ["VLLM", "POOL", "LAYER_OFFS", "IDS", "n_pairs", "v_sb", "v_st", "v_sh", "p_sb", "p_sl", "p_skv", "p_st",
             "p_sh"]
    types = [f"*i{8 * word}", f"*i{8 * word}", "*i64", "*i64"] + ["i32"] * 9
    head = 128 * 2 // word
    for into_vllm in (True, False):
        const = dict(TOKENS=16, HEADS=8, HEAD=head, HEAD_P=head, ROWS=16384 // (head * word), ALIGN=16 // word,
                     INTO_VLLM=into_vllm, BLOCKS_PER_PROGRAM=bpp, EVICT=evict)
        src = triton.compiler.ASTSource(fn=kernel,
                                        signature={**dict(zip(names, types, strict=True)),
                                                   **{name: "constexpr" for name in const}},
                                        constexprs=const, attrs={(i,): [["tt.divisibility", 16]] for i in range(13)
                                                                 if i not in (3, 4)})  # IDS, n_pairs: not specialised
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        ops = set(re.findall(r"(?:ld|st)\.global[.:\w]*", ptx))
        vec = "v2.b64" if word == 8 else "v4.b32"  # 16 bytes a thread either way
        hint = ".L1::evict_first.L2::cache_hint" if evict else ""
        assert ops - {"ld.global.b64"} == {f"ld.global{hint}.{vec}", f"st.global.{vec}"}, ops  # b64: the ids


def test_cpu_tensors_take_the_torch_path_and_say_why(vllm_pkg):
    bc = vllm_pkg[0]
    layers = make_layers("CPU", torch.float16, 4, 2, 16)
    pool = torch.zeros(P, L, 2, 4, 2, 16, dtype=torch.float16)
    copier = bc.BlockCopier(layers)
    copier.copy(pool, [4], [6], into_vllm=False)
    why = "Triton is not installed" if triton is None else "vLLM's KV cache is on cpu"
    assert copier.path == f"torch ({why})"
    for layer, (k, v) in enumerate(layers):
        assert torch.equal(bits(pool[4, layer, 0]), bits(k[6])) and torch.equal(bits(pool[4, layer, 1]), bits(v[6]))


@needs_triton
def test_what_the_kernel_refuses(vllm_pkg):
    bc = vllm_pkg[0]
    layers = make_layers("NHD", torch.float16, 4, 2, 16)
    copier = bc.BlockCopier(layers, kernel_on_cpu=True)
    pool = torch.zeros(P, L, 2, 4, 2, 16, dtype=torch.float16)
    assert copier.kernel_refusal(pool) is None
    assert "torch.bfloat16" in copier.kernel_refusal(pool.view(torch.bfloat16))
    assert "shape" in copier.kernel_refusal(pool[:, :2])  # a pool of other layers
    assert "strided" in copier.kernel_refusal(torch.zeros(P, L, 2, 4, 16, 2, dtype=torch.float16).transpose(4, 5))
    strided = [(k.transpose(2, 3), v.transpose(2, 3)) for k, v in make_layers("NHD", torch.float16, 4, 16, 16)]
    assert "strided" in bc.BlockCopier(strided, kernel_on_cpu=True).kernel_refusal(pool)
    mixed = layers[:2] + make_layers("HND", torch.float16, 4, 2, 16)[2:]
    assert "differ" in bc.BlockCopier(mixed, kernel_on_cpu=True).kernel_refusal(pool)


def test_block_ids_are_checked_before_anything_is_written(vllm_pkg):
    bc = vllm_pkg[0]
    layers = make_layers("CPU", torch.float16, 4, 2, 16)
    pool = torch.zeros(P, L, 2, 4, 2, 16, dtype=torch.float16)
    copier = bc.BlockCopier(layers)
    for pool_ids, vllm_ids, what in (([0, P], [1, 2], "pool block outside 0..10"),
                                     ([0, 1], [-1, 2], "vLLM block outside 0..8"), ([0, 1], [2], "different number")):
        with pytest.raises(ValueError, match=what):
            copier.copy(pool, pool_ids, vllm_ids, into_vllm=False)
    assert not pool.any()


def test_the_steps_id_arrays_are_its_copies_in_order_and_are_checked(vllm_pkg):
    bc, _, meta, _ = vllm_pkg
    step = meta.KVPoolConnectorMetadata("p", loads=[meta.BlockCopy("a", (1, 2), (3, 4)), meta.BlockCopy("b", (), ()),
                                                    meta.BlockCopy("c", (5,), (6,))],
                                        stores=[meta.BlockCopy("d", (7,), (8,))], saves=[meta.BlockCopy("e", (9,), (0,))])
    step.with_pairs()
    assert step.load_pairs.tolist() == [[1, 2, 5], [3, 4, 6]] and step.store_pairs.tolist() == [[7, 9], [8, 0]]
    assert meta.KVPoolConnectorMetadata("p").with_pairs().load_pairs.shape == (2, 0)
    with pytest.raises(ValueError, match="different number"):
        meta.pairs_of([meta.BlockCopy("x", (1,), ())])
    np = pytest.importorskip("numpy")
    for pairs, what in ((np.array([[0, -1], [1, 2]]), "pool block outside 0..10"),
                        (np.array([[0, 1], [1, N]]), "vLLM block outside 0..8"),
                        (np.array([[0], [1]], dtype=np.int32), "int64 array")):
        with pytest.raises(ValueError, match=what):
            bc.check_pairs(pairs, P, N)
    bc.check_pairs(np.array([[0, P - 1], [N - 1, 0]]), P, N)


def test_layer_offsets_and_their_alignment(vllm_pkg):
    bc = vllm_pkg[0]
    layers = make_layers("NHD", torch.float16, 4, 2, 16)
    offsets = bc.layer_offsets(layers)
    assert offsets[:2] == [0, 16]  # V: K's address + head (the CUDA backends' split)
    for (k, v), (ko, vo) in zip(layers, zip(offsets[::2], offsets[1::2], strict=True), strict=True):
        assert k.data_ptr() == layers[0][0].data_ptr() + 2 * ko and v.data_ptr() == layers[0][0].data_ptr() + 2 * vo
    assert bc.common_alignment([0, 128, -4096], 2) == 8  # 16 bytes of fp16
    assert bc.common_alignment([0, 128, 4], 2) == 4
    assert bc.common_alignment([0, 3], 2) == 1
    assert bc.common_alignment([0, 64], 4) == 4  # at most 16 bytes
    assert bc.common_alignment([0, 24], 1) == 8


def test_a_failed_copy_is_a_recompute_or_a_failed_store(vllm_pkg):
    _, vw, meta, st = vllm_pkg
    worker = vw.KVPoolWorker(st.ConnectorSettings("unix:/nonexistent"), st.ModelLayout(L, 2, 16, 4, "float16"))
    gen = torch.Generator().manual_seed(3)
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.randn(N, 2, 4, 32, generator=gen).half()
                               for i in range(L)})
    worker._pool_tensor = torch.zeros(P, L, 2, 4, 2, 16, dtype=torch.float16)  # as _attach leaves it
    worker._pool, worker._pool_id = type("Live", (), {"check_live": lambda self, what: None})(), "p"
    worker.start_load_kv(meta.KVPoolConnectorMetadata("p", loads=[meta.BlockCopy("a", (1, P), (3, 4))]))
    assert worker.get_block_ids_with_load_errors() == {3, 4} and worker.blocks_loaded == 0
    worker.start_load_kv(meta.KVPoolConnectorMetadata("p", saves=[meta.BlockCopy("b", (2, 5), (0, N))]))
    assert worker.worker_meta().failed_stores == {"b"} and worker.blocks_stored == 0
    assert not worker._pool_tensor.any()
    worker.start_load_kv(meta.KVPoolConnectorMetadata("p", saves=[meta.BlockCopy("c", (2, 5), (0, 7))]))
    assert worker.worker_meta() is None and worker.blocks_stored == 2
    assert worker.copy_path.startswith("torch (")
    k7 = worker._layers[1][0][7]
    assert torch.equal(worker._pool_tensor[5, 1, 0], k7)


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU run: scripts/gpu_check.sh vllm)")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_on_cuda_copies_of_every_size_launched_directly_match_the_torch_path(vllm_pkg, layout):
    """On a GPU: copies of 1 to 9 pairs, each with new ids, both directions -- the first through Triton's JIT, the
    rest launched directly (the compiled kernel serves every count: nothing about the ids is specialised on) --
    each byte for byte against the PyTorch path, every id array uploaded through the staging buffers."""
    bc = vllm_pkg[0]
    layers = [(k.cuda(), v.cuda()) for k, v in make_layers(layout, torch.float16, 16, 8, 128)]
    ref_layers = [(k.clone(), v.clone()) for k, v in layers]
    pool = torch.randn(P, L, 2, 16, 8, 128, generator=torch.Generator().manual_seed(3)).half().cuda()
    ref_pool = pool.clone()
    copier = bc.BlockCopier(layers)
    gen = torch.Generator().manual_seed(7)
    for n in (1, 2, 3, 5, 8, 9, 1, 4):
        pool_ids, vllm_ids = torch.randperm(P, generator=gen)[:n].tolist(), torch.randperm(N, generator=gen)[:n].tolist()
        for into_vllm in (True, False):
            copier.copy(pool, pool_ids, vllm_ids, into_vllm=into_vllm)
            bc._torch_copy(ref_layers, ref_pool, pool_ids, vllm_ids, into_vllm)
            assert copier.path == "triton"
            torch.cuda.synchronize()
            assert torch.equal(bits(pool), bits(ref_pool))
            for (k, v), (rk, rv) in zip(layers, ref_layers, strict=True):
                assert torch.equal(bits(k), bits(rk)) and torch.equal(bits(v), bits(rv))
    assert copier.direct and all(copier._launch[1].compiled.values()), "the copies after the first were not direct"
    assert copier.ids.uploads == 16


def test_a_launch_hook_is_set_only_when_one_is_registered(vllm_pkg):
    """The raw launch runs only without Triton's launch hooks (a profiler's): None or an empty HookChain."""
    bc = vllm_pkg[0]
    chain = type("HookChain", (), {"__init__": lambda self: setattr(self, "calls", [])})()
    assert bc.unhooked(None) and bc.unhooked(chain) and not bc.unhooked(print)
    chain.calls.append(print)
    assert not bc.unhooked(chain)
