"""Where a long register's time goes, part by part, in-process (issue 30, item 16): the prompt's chain hashes
(``prefix.prompt_hashes``), the locked part (``service.register`` given those hashes), the Free after it, and on
gRPC the request's parse and the client's building of it.

    .venv/bin/python benchmarks/register_cost.py --tokens 32768 --repeat 30
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.config import ServerConfig
from kvpool_server.service.build import build_service
from kvpool_server.service.scope import CallScope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    config = ServerConfig(backend="host", num_blocks=1 << 16, head_dim=1, max_seq_len=2 * args.tokens).validate()
    service, admission = build_service(config)
    scope = CallScope(admission, None, None)
    prefix = service.guard.manager.prefix
    rng = np.random.default_rng(0)
    parts: dict[str, list[float]] = {k: [] for k in ("hashes", "locked register", "free", "client build",
                                                     "gRPC parse")}
    try:
        for _ in range(args.repeat):
            prompt = rng.integers(0, 50_000, args.tokens, dtype=np.uint32)
            t0 = time.perf_counter()
            hashes = prefix.prompt_hashes(None, prompt)
            t1 = time.perf_counter()
            with scope.call("RegisterSequence") as call:
                seq_id = service.register(call, None, 0, 0, prompt, 0, b"", hashes).seq_id
            t2 = time.perf_counter()
            with scope.call("Free") as call:
                service.free(call, [seq_id])
            t3 = time.perf_counter()
            request = pb.RegisterSequenceRequest()
            request.prompt_token_ids.extend(prompt.tolist())
            raw = request.SerializeToString()
            t4 = time.perf_counter()
            pb.RegisterSequenceRequest.FromString(raw)
            t5 = time.perf_counter()
            for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                parts[name].append(seconds)
    finally:
        service.guard.pool.close()
    print(f"a {args.tokens}-token register, median of {args.repeat}:")
    for name, values in parts.items():
        print(f"  {name:<16} {np.median(values) * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
