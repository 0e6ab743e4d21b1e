"""The 256-sequence decode step of the core alone: one ``manager.append(ids)`` (or, on code before the one-append
refactor, ``append_batch``) of one token each, best of 7 x 2,000 steps, in microseconds. Run it on two trees to
compare them in one session (docs/results.md)::

    git archive a532fb2 server client | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/server:/tmp/old/client .venv/bin/python benchmarks/decode_step.py      # before
    .venv/bin/python benchmarks/decode_step.py                                                  # now

``--tenancy``: the same step as one tenant of a manager with tenancy on (a server with ``--auth-tokens``), whose
ids resolve in the tenant's namespace (docs/security.md).

``--token-ids``: the step of prefix caching -- each append carries its token's id, the sequences registered with
(distinct) prompts so that they are tracked: every 16th step fills a block of each row, hashed then and sealed by
the next.

``--phases`` (with ``--token-ids``): also each step of the 16-step cycle timed alone, the least of its 875 samples:
the quiet steps, the step that hashes 256 filled blocks and the one that seals them (steadier than the mean on a
shared machine).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from kvpool_server.core import KVCacheManager

NUM_SEQS, NUM_STEPS, PROMPT_LEN = 256, 2000, 20


def main() -> None:
    tenancy = "--tenancy" in sys.argv[1:]
    with_ids = "--token-ids" in sys.argv[1:]
    manager = KVCacheManager(num_blocks=65536, block_size=16, max_seq_len=4096, max_num_seqs=4096, tenancy=tenancy)
    old = hasattr(manager, "append_batch")  # the code before the one-append refactor
    tenant = manager.tenants.tenant_id("t") if tenancy else None
    step = manager.append_batch if old else manager.append if tenant is None else (
        lambda ids, n=1, token_ids=None: manager.append(ids, n, tenant, token_ids=token_ids))
    rng = np.random.default_rng(0)
    steps = rng.integers(0, 2**31, size=(NUM_STEPS, NUM_SEQS), dtype=np.uint32) if with_ids else [None] * NUM_STEPS

    def fresh_batch() -> np.ndarray:
        if not with_ids:
            ids = np.array([manager.register(tenant=tenant) for _ in range(NUM_SEQS)], dtype=np.uint64)
            for seq_id in ids.tolist():
                step([seq_id], PROMPT_LEN)  # a prompt of 20 tokens each
            return ids
        prompts = rng.integers(0, 2**31, size=(NUM_SEQS, PROMPT_LEN), dtype=np.uint32)  # distinct: nothing reused
        ids = np.array([manager.register(tenant=tenant, prompt_token_ids=p) for p in prompts], dtype=np.uint64)
        for seq_id, prompt in zip(ids.tolist(), prompts):
            step([seq_id], PROMPT_LEN, token_ids=prompt)
        return ids

    ids = fresh_batch()
    best = float("inf")
    phases = [float("inf")] * 16  # the least time of each step of the 16-step cycle (--phases)
    clock = time.perf_counter
    for _ in range(7):
        start = clock()
        if with_ids and "--phases" in sys.argv[1:]:
            for k, tokens in enumerate(steps):
                at = clock()
                step(ids, token_ids=tokens)
                phases[k % 16] = min(phases[k % 16], clock() - at)
        elif with_ids:
            for tokens in steps:
                step(ids, token_ids=tokens)
        else:
            for _ in range(NUM_STEPS):
                step(ids)
        best = min(best, (clock() - start) / NUM_STEPS)
        manager.free(ids.tolist(), tenant)
        ids = fresh_batch()
    flags = [name for name, on in (("tenancy on", tenancy), ("token ids", with_ids)) if on]
    suffix = f" ({', '.join(flags)})" if flags else ""
    print(f"{best * 1e6:.2f} us per 256-sequence decode step{suffix}")
    if phases[0] != float("inf"):
        hashing = (15 - PROMPT_LEN % 16) % 16  # the step that fills every row's block (rows start at PROMPT_LEN)
        quiet = sorted(phases)[7]
        print(f"  alone: a quiet step {quiet * 1e6:.1f} us, the hashing step {phases[hashing] * 1e6:.0f} us, the "
              f"sealing step {phases[(hashing + 1) % 16] * 1e6:.0f} us; their mean over the cycle "
              f"{sum(phases) / 16 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
