"""The other kernels for a cache hit's suffix attention, against ``kernels/split_kv.py``'s flash split (run by
``bench_split_kv.py --variants``): each variant's whole attention (its calls, the copies it needs, the merge) in a
CUDA graph, its output checked against the flash split's (largest difference over the largest |output|, < 2e-3).

- ``triton``: ``kernels/split_kv_triton.py``, one launch for the pieces and the own keys, query heads of a KV head
  together, pieces x tile sizes; the exact context and the graph bucket's (lengths on the device);
- ``flash-gqa``: the varlen flash call with the query heads of a KV head as rows (KV heads only), pieces;
- ``cudnn``: SDPA's cuDNN kernel (``aten::_scaled_dot_product_cudnn_attention``, log-sum-exp out), the pieces as
  its batch, K/V as strided views (exact context only: its lengths are the tensors' shapes); GQA native or by
  repeating K/V;
- ``cudnn-varlen``: ``aten::_cudnn_attention_forward`` with cumulative lengths (as the flash split's);
- ``flex``: FlexAttention compiled, the pieces as its batch, GQA native (exact context).
"""

from __future__ import annotations

import importlib.metadata
import time
from typing import Any


def _versions(torch: Any) -> None:
    names = ("torch", "triton", "flash_attn", "flash_attn_3", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} -")
    print("versions:", ", ".join(found), f"| cudnn {torch.backends.cudnn.version()}",
          f"| SDPA enabled: flash {torch.backends.cuda.flash_sdp_enabled()}, "
          f"efficient {torch.backends.cuda.mem_efficient_sdp_enabled()}, "
          f"cudnn {torch.backends.cuda.cudnn_sdp_enabled()}, math {torch.backends.cuda.math_sdp_enabled()}")


def variants(torch: Any, mean_ms: Any, q: Any, k: Any, v: Any, n: int, m: int, bucket: int, scale: float) -> None:
    from kvpool_client.kernels import split_kv, split_kv_triton  # noqa: PLC0415
    from kvpool_client.kernels.prefill_attention import PrefillSpans, _math_attention  # noqa: PLC0415

    _versions(torch)
    dev, (_, hq, dim), hkv = q.device, q.shape, k.shape[1]
    group, p = hq // hkv, m - n
    spans = PrefillSpans.of([(0, n, torch.arange(m, device=dev))])
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    chosen = split_kv.pieces_for(n, m, hq, sms)
    plan = split_kv.make_plan(spans.cu_k, n, m, chosen)
    ref = split_kv.split_attention(q, k, v, plan, scale).float()
    top = ref.abs().max().item()
    exact = _math_attention(q.float(), k[:m].float(), v[:m].float(), spans, group, scale)
    base = mean_ms(torch, lambda: split_kv.split_attention(q, k, v, plan, scale))
    flops = 4 * n * hq * dim * (p + (n + 1) / 2)
    print(f"flash split ({chosen} pieces): {base * 1e3:6.1f} us, {flops / base / 1e9:5.0f} TFLOP/s; "
          f"vs float32 math {(ref - exact).abs().max().item() / top:.1e}")

    def report(label: str, fn: Any) -> None:
        try:
            got = fn().float()
            err = (got - ref).abs().max().item() / top
            t = mean_ms(torch, fn)
        except Exception as exc:  # noqa: BLE001  (a variant this build lacks: say so, go on)
            print(f"  {label}: failed {exc!r:.160}")
            return
        ok = "ok" if err < 2e-3 else "WRONG"
        print(f"  {label}: {t * 1e3:6.1f} us ({base / t:.2f}x), {flops / t / 1e9:5.0f} TFLOP/s, err {err:.1e} {ok}")

    def triton_split(kk: Any, vv: Any, cu_own: Any, pieces: int, cfg: dict[str, int]) -> Any:
        out, lse = split_kv_triton.pieces_attention(q, kk, vv, cu_own, pieces, scale, config=cfg)
        return split_kv.merge(out[:pieces].view(pieces * n, hq, dim), out[pieces], lse)

    configs = [{"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
               {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
               {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
               {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}]
    bucket_cu = split_kv.make_plan(spans.cu_k, n, bucket, 4).cu_own  # the same [p, m], as a graph's bucket has it
    print("triton (kernels/split_kv_triton.py + merge), exact context:")
    for pieces in (2, 3, 4, 6, 8, 12):
        for cfg in configs:
            tag = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
            report(f"{pieces:2d} pieces {tag}", lambda pc=pieces, c=cfg: triton_split(k, v, plan.cu_own, pc, c))
    print(f"triton in the bucket of {bucket} (k/v rows past m unread):")
    for pieces in (3, 4, 6, 8):
        report(f"{pieces:2d} pieces default", lambda pc=pieces: triton_split(k, v, bucket_cu, pc, split_kv_triton.CONFIG))

    print("flash-gqa (the group's query heads as rows):")
    for pieces in (2, 4, 8):
        pl = split_kv.make_plan(spans.cu_k, n, m, pieces)
        cu_q = torch.arange(pieces + 1, dtype=torch.int32, device=dev) * (group * n)

        def flash_gqa(pl: Any = pl, cu_q: Any = cu_q, s: int = pieces) -> Any:
            qg = q.view(n, hkv, group, dim).permute(2, 0, 1, 3).reshape(group * n, hkv, dim).repeat(s, 1, 1)
            o, lse = split_kv._flash(qg, k, v, cu_q, pl.cu_k, group * n, pl.max_piece, False, scale)
            o = o.view(s, group, n, hkv, dim).permute(0, 2, 3, 1, 4).reshape(s * n, hq, dim)
            lse = lse.view(hkv, s, group, n).permute(0, 2, 1, 3).reshape(hq, s, n)
            o_own, lse_own = split_kv._flash(q, k, v, pl.cu_q[:2], pl.cu_own, n, n, True, scale)
            return split_kv.merge(o, o_own, torch.cat([lse, lse_own.view(hq, 1, n)], 1).contiguous())
        report(f"{pieces:2d} pieces", flash_gqa)

    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            a = torch.randn(1, 8, 256, 128, device=dev, dtype=q.dtype)
            b = torch.randn(1, 2, 512, 128, device=dev, dtype=q.dtype)
            torch.nn.functional.scaled_dot_product_attention(a, b, b, enable_gqa=True)
        native_gqa = True
        print("cudnn: SDPA's cuDNN backend takes enable_gqa")
    except Exception as exc:  # noqa: BLE001
        native_gqa = False
        print(f"cudnn: SDPA's cuDNN backend with enable_gqa failed ({exc!r:.160}): K/V repeated")

    def lse4(lse: Any, s: int) -> Any:  # cuDNN's [B, H, S(, 1)] -> [H, B, S]
        return lse.reshape(s, hq, n).permute(1, 0, 2)

    for pieces in (2, 4, 8):
        if p % pieces:
            continue
        piece = p // pieces
        for native in ((True, False) if native_gqa else (False,)):
            def cudnn_split(s: int = pieces, piece: int = piece, native: bool = native) -> Any:
                qb = q.repeat(s, 1, 1).view(s, n, hq, dim).permute(0, 2, 1, 3)
                kb = k[:p].view(s, piece, hkv, dim).permute(0, 2, 1, 3)
                vb = v[:p].view(s, piece, hkv, dim).permute(0, 2, 1, 3)
                ko = k[p:m].view(1, n, hkv, dim).permute(0, 2, 1, 3)
                vo = v[p:m].view(1, n, hkv, dim).permute(0, 2, 1, 3)
                if not native:
                    kb, vb, ko, vo = (t.repeat_interleave(group, dim=1) for t in (kb, vb, ko, vo))
                o, lse = cudnn(qb, kb, vb, None, True, 0.0, False, False, scale=scale)[:2]
                oo, lo = cudnn(q.view(1, n, hq, dim).permute(0, 2, 1, 3), ko, vo, None, True, 0.0, True, False,
                               scale=scale)[:2]
                return split_kv.merge(o.permute(0, 2, 1, 3).reshape(s * n, hq, dim),
                                      oo.permute(0, 2, 1, 3).reshape(n, hq, dim),
                                      torch.cat([lse4(lse, s), lse4(lo, 1)], 1).contiguous())
            report(f"cudnn {pieces:2d} pieces, GQA {'native' if native else 'repeated'}", cudnn_split)

    def cudnn_varlen(pl: Any, s: int) -> Any:
        qr = q.repeat(s, 1, 1)
        r = torch.ops.aten._cudnn_attention_forward(qr, k, v, None, pl.cu_q, pl.cu_k, n, pl.max_piece, True, 0.0,
                                                    False, False, scale=scale)
        ro = torch.ops.aten._cudnn_attention_forward(q, k, v, None, pl.cu_q[:2], pl.cu_own, n, n, True, 0.0, True,
                                                     False, scale=scale)
        lse = r[1].reshape(s * n, hq).t().reshape(hq, s, n)
        lse_own = ro[1].reshape(n, hq).t().reshape(hq, 1, n)
        return split_kv.merge(r[0], ro[0], torch.cat([lse, lse_own], 1).contiguous())

    for pieces in (4, 8):
        pl = split_kv.make_plan(spans.cu_k, n, m, pieces)
        t0 = time.perf_counter()
        try:
            cudnn_varlen(pl, pieces)
            torch.cuda.synchronize()
            print(f"  cudnn-varlen eager call: {(time.perf_counter() - t0) * 1e3:.1f} ms on the host (first)")
        except Exception as exc:  # noqa: BLE001
            print(f"  cudnn-varlen {pieces} pieces: failed {exc!r:.160}")
            continue
        report(f"cudnn-varlen {pieces:2d} pieces", lambda pl=pl, s=pieces: cudnn_varlen(pl, s))

    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as exc:  # noqa: BLE001
        print(f"flex: unavailable ({exc!r:.160})")
        return
    for pieces in (4, 8):
        piece = p // pieces

        def flex_split(s: int = pieces, piece: int = piece) -> Any:
            qb = q.view(1, n, hq, dim).permute(0, 2, 1, 3).expand(s, hq, n, dim)
            kb = k[:p].view(s, piece, hkv, dim).permute(0, 2, 1, 3)
            vb = v[:p].view(s, piece, hkv, dim).permute(0, 2, 1, 3)
            o, lse = flex(qb, kb, vb, scale=scale, enable_gqa=True, return_lse=True)
            o_own, lse_own = split_kv._flash(q, k, v, plan.cu_q[:2], plan.cu_own, n, n, True, scale)
            return split_kv.merge(o.permute(0, 2, 1, 3).reshape(s * n, hq, dim), o_own,
                                  torch.cat([lse.permute(1, 0, 2), lse_own.view(hq, 1, n)], 1).contiguous())
        t0 = time.perf_counter()
        report(f"flex {pieces} pieces (+ flash own keys)", flex_split)
        print(f"    (with its compile: {time.perf_counter() - t0:.1f} s)")
