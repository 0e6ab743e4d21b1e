"""The prefill attention of a cache hit's suffix, alone, on CUDA (``kernels/split_kv.py``): 256 new tokens of
Llama-3-8B's attention (32 query heads, 8 KV heads, head size 128, fp16) over a 4,352-key context, and the same as
a prefill graph's bucket sees it (the keys gathered for the bucket's 8,192 slots, the real lengths in ``cu_k``):
one varlen flash call against the split (pieces chosen by ``pieces_for``, and each count from 2 to 16), the
pool's gather of the context (``kvpool::read_layer``) beside them. Each captured in a CUDA graph (as a prefill
graph runs it: the device's time, no launch cost), mean of 50 replays; 32 layers' worth is 32 times the figure.

    PYTHONPATH=server:common:client python3 benchmarks/bench_split_kv.py [--new 256] [--context 4352]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "common"), str(ROOT / "client")]


def mean_ms(torch, fn, n: int = 50) -> float:
    """The device's time of ``fn`` per call: captured in a CUDA graph (no launch cost on the host, as in a prefill
    graph's replay), the graph replayed ``n`` times between CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--context", type=int, default=4352)
    parser.add_argument("--bucket", type=int, default=8192)
    parser.add_argument("--variants", action="store_true",
                        help="also the other kernels (bench_split_kv_variants.py): Triton, cuDNN, FlexAttention")
    args = parser.parse_args()
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    from kvpool_client.kernels import split_kv  # noqa: PLC0415
    from kvpool_client.kernels.prefill_attention import PrefillSpans  # noqa: PLC0415

    n, m, scale = args.new, args.context, 128 ** -0.5
    dev = torch.device("cuda")
    q = torch.randn(n, 32, 128, device=dev, dtype=torch.float16)
    k, v = (torch.randn(args.bucket, 8, 128, device=dev, dtype=torch.float16) for _ in range(2))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    spans = PrefillSpans.of([(0, n, torch.arange(m, device=dev))])
    cu_q, cu_k = spans.cu_q, spans.cu_k
    for label, max_k in (("exact context", m), (f"bucket of {args.bucket}", args.bucket)):
        one = mean_ms(torch, lambda mk=max_k: split_kv._flash(q, k, v, cu_q, cu_k, n, mk, True, scale))
        chosen = split_kv.pieces_for(n, max_k, 32, sms)
        print(f"{n} new tokens over {m} keys ({label}): one flash call {one * 1e3:7.1f} us; pieces_for -> {chosen}")
        for pieces in (2, 3, 4, 5, 6, 8, 12, 16):
            plan = split_kv.make_plan(cu_k, n, max_k, pieces)
            t = mean_ms(torch, lambda p=plan: split_kv.split_attention(q, k, v, p, scale))
            flash_only = mean_ms(torch, lambda p=plan: (
                split_kv._flash(q.repeat(p.pieces, 1, 1), k, v, p.cu_q, p.cu_k, n, p.max_piece, False, scale),
                split_kv._flash(q, k, v, p.cu_q[:2], p.cu_own, n, n, True, scale)))
            print(f"  {pieces:2d} pieces: {t * 1e3:7.1f} us ({one / t:.2f}x), of which the two flash calls and the "
                  f"repeat {flash_only * 1e3:6.1f} us{'  <- chosen' if pieces == chosen else ''}")
    if args.variants:
        from bench_split_kv_variants import variants  # noqa: PLC0415

        variants(torch, mean_ms, q, k, v, n, m, args.bucket, scale)
    blocks = torch.zeros(600, 32, 2, 16, 8, 128, device=dev, dtype=torch.float16)
    try:
        import kvpool_client.kernels.torch_ops  # noqa: F401, PLC0415  (registers kvpool::read_layer)

        error = torch.zeros(1, dtype=torch.int32, device=dev)
        for slots in (m, args.bucket):
            ctx = torch.arange(slots, device=dev) % (600 * 16)
            t = mean_ms(torch, lambda c=ctx: torch.ops.kvpool.read_layer(blocks, 3, c, error))
            print(f"kvpool::read_layer of {slots} slots (one layer's K and V): {t * 1e3:7.1f} us")
    except (ImportError, RuntimeError, AttributeError) as exc:
        print(f"read_layer not measured: {exc!r:.200}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
