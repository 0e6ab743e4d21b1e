"""Run under ``TRITON_INTERPRET=1`` (a subprocess of ``test_split_kv_triton.py``: the interpreter must be chosen
before Triton is imported): ``kernels/split_kv_triton.py``'s kernel on CPU tensors, its pieces merged, against the
float32 math path -- GQA groups of 1, 2 and 4, pieces without keys, a padded bucket, partial tiles, fp16 and float32
(bf16: on CUDA only, in test_split_kv_triton.py; the interpreter computes it wrong).
Exits non-zero with the failing case on stderr."""

from __future__ import annotations

import os
import sys

import torch

from kvpool_client.kernels import split_kv, split_kv_triton
from kvpool_client.kernels.prefill_attention import PrefillSpans, _math_attention

CASES = [  # n, m, rows of k/v (the bucket), pieces, Hq, Hkv, D, BLOCK_M, BLOCK_N, dtype
    (16, 300, 300, 4, 4, 2, 16, 16, 16, torch.float16),
    (9, 40, 64, 3, 4, 1, 16, 16, 16, torch.float16),  # a bucket: rows 40.. are never read
    (5, 5, 5, 3, 2, 2, 16, 16, 16, torch.float16),  # no prefix: every piece without keys
    (33, 200, 512, 2, 4, 2, 32, 32, 16, torch.float16),  # a partial query block
    (7, 1000, 1000, 5, 8, 2, 16, 16, 32, torch.float32),
]


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for n, m, rows, pieces, hq, hkv, dim, block_m, block_n, dtype in CASES:
        gen = torch.Generator().manual_seed(n * 100 + m)
        q = torch.randn(n, hq + 2 * hkv, dim, generator=gen).to(dtype)[:, :hq]  # a view of a QKV product's rows
        k, v = (torch.randn(rows, hkv, dim, generator=gen).to(dtype) for _ in range(2))
        k[m:], v[m:] = 1e4, float("nan")  # rows past the span: a read of one would show
        cu_own = torch.tensor([m - n, m], dtype=torch.int32)
        out, lse = split_kv_triton.pieces_attention(q, k, v, cu_own, pieces, 0.3,
                                                    config={"BLOCK_M": block_m, "BLOCK_N": block_n})
        if (m == n) != bool(torch.isinf(lse[:, :pieces]).all()) or torch.isinf(lse[:, pieces]).any():
            print(f"case {n, m, pieces}: lse +inf where a piece has keys, or finite where it has none",
                  file=sys.stderr)
            return 1
        got = split_kv.merge(out[:pieces].reshape(pieces * n, hq, dim), out[pieces], lse).float()
        want = _math_attention(q.float(), k[:m].float(), v[:m].float(), PrefillSpans.of([(0, n, torch.arange(m))]),
                               hq // hkv, 0.3)
        err = (got - want).abs().max().item()
        if not err < 2e-2:
            print(f"case {n, m, pieces, hq, hkv, dtype}: largest difference {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
