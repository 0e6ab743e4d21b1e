"""--prefix-eviction picks the prefix cache's eviction policy of a real server (docs/prefix-caching.md, Eviction
policy): under lru a prompt used once, newer, outlives one used twice; under lrfu the one used twice stays. A value
the server does not know is refused at start, naming the setting."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvpool_client import KVPoolClient

BLOCK = 4


def serve(client: KVPoolClient, prompt: np.ndarray) -> int:
    seq_id, cached = client.register_prompt(prompt)
    client.append(seq_id, prompt.size - cached, token_ids=prompt[cached:])
    client.append(seq_id, 1)  # seals the prompt's blocks
    client.free(seq_id)
    return cached


@pytest.mark.parametrize(("policy", "kept"), [("lru", "b"), ("lrfu", "a")])
def test_the_policy_decides_which_prompt_survives(server_factory, policy: str, kept: str) -> None:
    server = server_factory("--num-blocks", "5", "--block-size", str(BLOCK), "--prefix-eviction", policy)
    a, b, c = (np.arange(k, k + 2 * BLOCK + 1, dtype=np.uint32) for k in (0, 100, 200))
    with KVPoolClient(server.address) as client:
        assert serve(client, a) == 0 and serve(client, a) == 2 * BLOCK  # a: used twice
        assert serve(client, b) == 0  # b: once, newer
        serve(client, c)  # 3 blocks: evicts a's or b's two
        assert serve(client, a if kept == "a" else b) == 2 * BLOCK


def test_an_unknown_policy_is_refused_at_start() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvpool_server.main", "--backend", "host", "--num-blocks", "8",
                           "--prefix-eviction", "arc"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--prefix-eviction" in proc.stderr and "arc" in proc.stderr
