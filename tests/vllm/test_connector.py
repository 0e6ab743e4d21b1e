"""KVPoolConnector with the real vLLM (CPU) and a real kvpool server (host pool, block size 32, three tenants).

Three engine processes live for the whole module (an engine takes 30-80 s to start on two cores): ``plain`` has no
connector (the reference outputs), ``a`` and ``b`` have the connector with tenant alpha's token; ``a`` is started
before kvpool is and runs its engine core in the driver's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; ``b`` has
vLLM's default, a process of its own), so that a test can leave a's requests running (``Engine.start``: nothing
steps them) while it checks kvpool, kills it or kills the engine. The tests run in order and build on each other's
kvpool state, as a host's engines would.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` installs it (CPU) and runs these")

from tests.vllm.harness import QUOTA_BLOCKS, Engine, KVPoolServer, wait_for  # noqa: E402
from tests.vllm.tiny_model import BLOCK_SIZE, write_tiny_llama  # noqa: E402

from kvpool_client.integrations.vllm.scheduler import SEAL_WITHIN_STEPS  # noqa: E402

pytestmark = pytest.mark.timeout(1800)
PREFIX = 544  # 17 blocks: more than 512 tokens in common


def prompt(seed: int, length: int, prefix_seed: int | None = None) -> list[int]:
    """Deterministic token ids in [3, 511): the first PREFIX from ``prefix_seed`` when given."""
    head = [] if prefix_seed is None else [(prefix_seed * 131 + j * 17) % 508 + 3 for j in range(PREFIX)]
    return head + [(seed * 97 + j * 29 + 7) % 508 + 3 for j in range(length - len(head))]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm")
    model = write_tiny_llama(work / "model")
    sock_dir = tmp_path_factory.mktemp("s", numbered=True)
    server = KVPoolServer(work, os.path.join(str(sock_dir), "kvpool.sock"))
    fault = work / "fail-loads"
    common = ("--target", server.address, "--token-file", str(server.token_files["alpha"]))
    engines = {"plain": Engine("plain", model, work),
               "a": Engine("a", model, work, *common, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})}
    engines["a"].wait_ready()  # started while kvpool is absent
    server.start()
    engines["b"] = Engine("b", model, work, *common, env={"KVPOOL_VLLM_FAIL_LOADS_FILE": str(fault)})
    for engine in engines.values():
        engine.wait_ready()
    yield {"server": server, "fault": fault, "model": model, "work": work, **engines}
    for engine in engines.values():
        engine.stop()
    server.stop()


def settled(server: KVPoolServer) -> None:
    """Wait until no engine holds a kvpool sequence: every store sealed and freed."""
    def idle() -> bool:
        with server.client() as client:
            return client.stats().num_sequences == 0
    wait_for(idle, 60, "every kvpool sequence freed")


def test_kvpool_absent_at_start_is_one_warning_and_a_miss(env):
    a, plain = env["a"], env["plain"]
    warnings = [line for line in a.log().splitlines() if "is not reachable" in line]
    assert len(warnings) == 1, warnings
    prompts = [prompt(1, 300), prompt(2, 200)]
    assert a.generate(prompts)["outputs"] == plain.generate(prompts)["outputs"]
    wait_for(lambda: "connected to kvpool" in a.log(), 60, "engine a reconnects to kvpool")


def test_second_engine_gets_the_first_engines_prefix_from_kvpool(env):
    a, b, plain, server = env["a"], env["b"], env["plain"], env["server"]
    first = [prompt(10 + i, 600, prefix_seed=1) for i in range(3)]
    a.generate(first)
    settled(server)
    with server.client() as client:
        before = client.stats()
    second = [prompt(20 + i, 640, prefix_seed=1) for i in range(3)]
    got, want = b.generate(second), plain.generate(second)
    assert got["outputs"] == want["outputs"]
    assert all(n >= PREFIX // BLOCK_SIZE * BLOCK_SIZE for n in got["num_cached"]), got["num_cached"]
    # vLLM's accounting: the first request loads the prefix from kvpool; the others of the same step find it in
    # vLLM's own cache by then (its own hit comes first, the connector is asked only for what lies beyond).
    assert got["metrics"]["vllm:external_prefix_cache_hits"] >= PREFIX
    with server.client() as client:
        after = client.stats()
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= PREFIX


def test_both_engines_at_once(env):
    b, plain, server = env["b"], env["plain"], env["server"]
    sets = {"a": [prompt(30 + i, 700, prefix_seed=2) for i in range(3)],
            "b": [prompt(40 + i, 650, prefix_seed=2) for i in range(3)]}
    results: dict[str, dict] = {}
    threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, env[n].generate(sets[n], 16)))
               for n in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in sets:
        assert results[name]["outputs"] == plain.generate(sets[name], 16)["outputs"]
    settled(server)
    again = [prompt(50, 600, prefix_seed=2)]
    got = b.generate(again)
    assert got["outputs"] == plain.generate(again)["outputs"]
    assert got["num_cached"][0] >= PREFIX // BLOCK_SIZE * BLOCK_SIZE


def test_a_prompt_is_shared_while_the_engine_that_computed_it_still_generates(env):
    """Prompt blocks are stored after their prefill and sealed within SEAL_WITHIN_STEPS steps, not when the request
    ends: engine a's request is stepped past that and left running while kvpool is asked and engine b served."""
    a, b, plain, server = env["a"], env["b"], env["plain"], env["server"]
    long_running = [prompt(55, 600, prefix_seed=5)]
    a.start(long_running, 64, SEAL_WITHIN_STEPS + 2)
    with server.client("alpha") as alpha:
        seq, hit = alpha.register_prompt(long_running[0])
        alpha.free(seq)
    assert hit >= PREFIX // BLOCK_SIZE * BLOCK_SIZE
    other = [prompt(56, 640, prefix_seed=5)]
    got = b.generate(other)
    assert got["num_cached"][0] >= PREFIX // BLOCK_SIZE * BLOCK_SIZE
    assert got["outputs"] == plain.generate(other)["outputs"]
    assert a.finish()["outputs"] == plain.generate(long_running, 64)["outputs"]


def test_a_failed_load_is_recomputed_with_the_same_tokens(env):
    a, b, plain, server, fault = env["a"], env["b"], env["plain"], env["server"], env["fault"]
    prompts = [prompt(60 + i, 620, prefix_seed=3) for i in range(2)]
    a.generate(prompts)
    settled(server)
    fault.write_text("fail\n")
    try:
        got = b.generate([prompt(70, 640, prefix_seed=3)])
    finally:
        fault.unlink()
    assert got["outputs"] == plain.generate([prompt(70, 640, prefix_seed=3)])["outputs"]
    assert "a load from kvpool failed" in b.log()


def test_tenants_share_nothing_and_one_tenant_shares_across_engines(env):
    server = env["server"]
    cached = prompt(10, 600, prefix_seed=1)  # engine a stored its prefix for alpha
    with server.client("beta") as beta:
        seq, hit = beta.register_prompt(cached)
        assert hit == 0
        beta.free(seq)
    with server.client("alpha") as alpha:
        seq, hit = alpha.register_prompt(cached)
        assert hit >= PREFIX // BLOCK_SIZE * BLOCK_SIZE
        alpha.free(seq)
    # beta's own prompt, written by a beta frontend: alpha's engines never see it.
    theirs = prompt(80, 600)
    with server.client("beta") as beta:
        write_prompt(beta, theirs)
    got = env["a"].generate([theirs])
    assert got["num_cached"] == [0]
    assert got["outputs"] == env["plain"].generate([theirs])["outputs"]


def write_prompt(client, tokens: list[int]) -> None:
    """A kvpool frontend's prefill: register, append with the token ids, write KV, seal (one more append), free."""
    import numpy as np

    seq, cached = client.register_prompt(tokens)
    rest = tokens[cached:]
    result = client.append([seq], len(rest), token_ids=rest)
    pool = client.attach()
    layout = pool.layout
    kv = np.random.default_rng(0).standard_normal((len(rest), *layout.token_shape)).astype(np.float32)
    pool.write_slots(result.slot_mapping, kv)
    client.append([seq], 1, token_ids=[3])
    client.free(seq)


def test_a_kvpool_frontend_and_a_vllm_engine_find_each_others_prompts(env):
    server, b = env["server"], env["b"]
    ours = prompt(90, 600)
    with server.client("alpha") as alpha:
        write_prompt(alpha, ours)
    got = b.generate([ours])
    assert got["num_cached"][0] >= 576  # the frontend's 18 full blocks (its KV: random, so outputs are its own)
    engine_prompt = prompt(91, 600)
    env["a"].generate([engine_prompt])
    settled(server)
    with server.client("alpha") as alpha:
        seq, hit = alpha.register_prompt(engine_prompt + [5])
        assert hit == 18 * BLOCK_SIZE
        kv = alpha.read_kv(seq)
        assert kv.shape[0] == hit and float(abs(kv).sum()) > 0
        alpha.free(seq)


def test_kvpool_sigkilled_mid_generation_then_restarted(env):
    a, b, plain, server = env["a"], env["b"], env["plain"], env["server"]
    prompts = [prompt(100 + i, 600, prefix_seed=1) for i in range(4)]  # prefix hits: loads in flight too
    want = plain.generate(prompts, 128)["outputs"]
    a.start(prompts, 128, 4)  # running, holding kvpool sequences
    with server.client() as client:
        assert client.stats().num_sequences >= len(prompts)
    server.kill()
    assert a.finish()["outputs"] == want
    server.start()
    wait_for(lambda: a.log().count("connected to kvpool") >= 2, 60, "engine a reconnects to the new kvpool")
    later = [prompt(110, 600, prefix_seed=4)]
    a.generate(later)
    settled(server)
    b.generate([prompt(112, 100)])  # b finds kvpool gone at its first call, and reconnects in the background
    wait_for(lambda: "connected to kvpool" in b.log(), 60, "engine b reconnects to the new kvpool")
    got = b.generate([prompt(111, 640, prefix_seed=4)])
    assert got["outputs"] == plain.generate([prompt(111, 640, prefix_seed=4)])["outputs"]
    assert got["num_cached"][0] >= PREFIX // BLOCK_SIZE * BLOCK_SIZE


def test_a_crashed_engine_leaves_nothing_pinned_in_kvpool(env):
    """SIGKILL an engine (its whole process group) while its requests hold kvpool sequences: the session ends with
    its connection and kvpool frees them all (runs last: the engine stays dead)."""
    a, server = env["a"], env["server"]
    prompts = [prompt(120 + i, 600, prefix_seed=6) for i in range(4)]
    a.start(prompts, 1500, 4)  # running, holding kvpool sequences
    with server.client() as client:
        assert client.stats().num_sequences >= len(prompts)
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait(60)
    settled(server)
    with server.client() as client:
        assert client.stats().num_blocks_used == 0  # every block it pinned or was storing: free or cached



def test_a_tenants_quota_makes_stores_misses_never_errors(env):
    """An engine whose tenant (gamma) has max_blocks = QUOTA_BLOCKS: a prompt store over it is refused by kvpool
    (RESOURCE_EXHAUSTED) and is a miss for that request alone -- the same tokens as without the connector, the link
    kept, nothing of the refused store left in kvpool -- while a prompt within the quota is stored and found (runs
    after engine a is gone: its CPU goes to this engine's start)."""
    server, plain = env["server"], env["plain"]
    q = Engine("quota", env["model"], env["work"], "--target", server.address, "--token-file",
               str(server.token_files["gamma"]), env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        q.wait_ready()
        big = [prompt(131 + i, 640, prefix_seed=7) for i in range(2)]  # 20 full blocks each: over the quota
        small = [prompt(130, 200)]  # 6 full blocks: within it
        with server.client("alpha") as alpha:
            alpha_before = alpha.stats()
        assert q.generate(big, 16)["outputs"] == plain.generate(big, 16)["outputs"]
        assert q.generate(small, 16)["outputs"] == plain.generate(small, 16)["outputs"]
        again = q.generate(big, 16)  # looked up again: still a miss in kvpool (vLLM's own cache may hit)
        assert again["outputs"] == plain.generate(big, 16)["outputs"]
        settled(server)
        with server.client("gamma") as gamma:
            usage = gamma.stats().tenants[0]
            seq, small_hit = gamma.register_prompt(small[0])
            gamma.free(seq)
            seq, big_hit = gamma.register_prompt(big[0])
            gamma.free(seq)
        assert (usage.tenant, usage.max_blocks, usage.num_sequences, usage.num_blocks) == ("gamma", QUOTA_BLOCKS, 0, 0)
        assert small_hit == (200 - 1) // BLOCK_SIZE * BLOCK_SIZE  # stored: the quota did not stop the link
        assert big_hit == 0  # refused whole, never sealed: nothing of it matchable
        log = q.log()
        assert "KVPoolConnector:" not in log, log[-3000:]  # no warning: the link stayed up, no store "failed"
        with server.client("alpha") as alpha:
            alpha_after = alpha.stats()
        assert alpha_after.num_blocks_used == alpha_before.num_blocks_used == 0  # the pool holds nothing pinned
    finally:
        q.stop()
