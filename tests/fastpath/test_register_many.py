"""RegisterSequences of several prompts over the fast path, in one register-many record, against real server
processes: the same answers and pool state as gRPC, all or none with gRPC's statuses, hostile records refused
unapplied, no gRPC call."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool import fastpath as fp
from kvpool import fastpath_codec as codec
from kvpool_client import KVPoolClient, KVPoolClientError
from tests.fastpath.in_process import in_process_server, refusing_op
from tests.grpc_counting import counting_grpc

POOL = ("--num-blocks", "2048", "--head-dim", "8", "--max-batch", "8", "--max-seq-len", "4096",
        "--max-tokens-per-call", "9000")
INVALID_ARGUMENT = 3


def seal(client: KVPoolClient, prompt: np.ndarray, key: bytes = b"") -> None:
    """Register ``prompt`` and append it (token ids): its full blocks are cached from then on."""
    seq, cached = client.register_prompt(prompt, cache_extra_key=key)
    client.append(seq, prompt.size - cached, token_ids=prompt[cached:])
    client.append(seq, 1, token_ids=[1])


def batches(rng: np.random.Generator) -> list[tuple[list[np.ndarray], list[bytes]]]:
    base = np.arange(3, 3 + 1200, dtype=np.uint32)
    other = rng.integers(0, 50_000, 700).astype(np.uint32)
    return [
        ([base[:100], base[:40], other[:90]], []),  # shared prefixes, a miss
        ([base[:100], base[:100]], [b"k", b""]),  # a key: its own blocks
        ([base[:17], base[:16], base[:15], base[:1]], [b"", b"", b"", b""]),  # at and under a block
        ([base[:1200], other[:700], base[:1100]], []),  # long: hashed on the hasher, not the thread
        ([rng.integers(0, 1000, int(n)).astype(np.uint32) for n in rng.integers(1, 300, 8)], []),
        ([base[:600]] * 5, [b"a", b"b", b"a", b"", b"b"]),
    ]


def workload(client: KVPoolClient) -> list:
    """Prompts sealed, then batches looked up; every answer with seq ids replaced by their order of creation."""
    names: dict[int, int] = {}
    rng = np.random.default_rng(5)
    base = np.arange(3, 3 + 1200, dtype=np.uint32)
    seal(client, base[:1000])
    seal(client, base[:200], b"k")
    seal(client, base[:600], b"a")
    out: list = []
    live: list[int] = []
    for prompts, keys in batches(rng):
        found = client.register_prompts(prompts, cache_extra_keys=keys)
        out.append([(names.setdefault(r.seq_id, len(names)), r.num_cached_tokens, r.cached_block_ids.tolist(),
                     r.cached_block_ids.dtype.name) for r in found])
        for r in found:
            assert client.block_table(r.seq_id).block_ids.tolist() == r.cached_block_ids.tolist()
        if len(out) % 2:
            client.free([r.seq_id for r in found[:1]])
            found = found[1:]
        live += [r.seq_id for r in found]
    for seq_id in live:  # the pool state: every sequence's table
        table = client.block_table(seq_id)
        out.append((names[seq_id], table.block_ids.tolist(), table.num_tokens))
    out.append(client.stats())
    return out


def test_batches_over_the_fast_path_answer_as_over_grpc_and_make_no_grpc_call(server_factory):
    fast_server, grpc_server = server_factory(*POOL), server_factory(*POOL)
    with KVPoolClient(fast_server.address) as fast, KVPoolClient(grpc_server.address, fast_path=False) as slow:
        fast.free(fast.register())  # the channel open
        calls = counting_grpc(fast)
        fast_answers = workload(fast)
        assert fast.fast_path_open and "RegisterSequences" not in calls, calls
        slow_answers = workload(slow)
        assert fast.check_invariants().ok and slow.check_invariants().ok
    assert fast_answers == slow_answers
    assert sum(n for batch in fast_answers[:6] for _, n, _, _ in batch) > 3000  # found blocks


def refusals(client: KVPoolClient) -> list:
    base = np.arange(3, 3 + 5000, dtype=np.uint32)
    bad = [
        ([base[:50], base[:0], base[:40]], []),  # an empty prompt
        ([base[:50], base[:4097]], []),  # over --max-seq-len
        ([base[:50], base[:60]], [b"", b"x" * 300]),  # a key over 256 bytes
        ([base[:10]] * 9, []),  # over --max-batch
        ([base[:3000]] * 4, []),  # over --max-tokens-per-call
    ]
    out = []
    for prompts, keys in bad:
        with pytest.raises(KVPoolClientError) as error:
            client.register_prompts(prompts, cache_extra_keys=keys)
        out.append((type(error.value).__name__, error.value.code, error.value.details))
        assert client.stats().num_sequences == 1, "a refused batch registered something"
    return out


def test_a_batch_with_one_bad_prompt_is_refused_with_grpcs_status_and_registers_nothing(server_factory):
    fast_server, grpc_server = server_factory(*POOL), server_factory(*POOL)
    with KVPoolClient(fast_server.address) as fast, KVPoolClient(grpc_server.address, fast_path=False) as slow:
        fast.register(), slow.register()
        calls = counting_grpc(fast)
        fast_errors = refusals(fast)
        assert "RegisterSequences" not in calls and fast.fast_path_open
        assert fast_errors == refusals(slow)
        assert all(e[0] == "InvalidArgumentError" for e in fast_errors), fast_errors
        found = fast.register_prompts([np.arange(40, dtype=np.uint32), np.arange(9, dtype=np.uint32)])
        assert len(found) == 2 and fast.fast_path_open  # the channel still serves
        assert fast.stats().num_sequences == 3 and fast.check_invariants().ok


def hostile(channel, *, ids=(), counts=(), tokens=(), extra=b"", header: dict | None = None) -> int:
    """A register-many record written by hand into the segment (the header's counts as given, or the arrays');
    returns its reply code."""
    views = channel.views
    codec.write_request(views, fp.OP_REGISTER_MANY, 0, channel.generation, ids=np.asarray(ids, np.uint64),
                        counts=np.asarray(counts, np.uint32), tokens=np.asarray(tokens, np.uint32), extra=extra)
    for word, value in (header or {}).items():
        views.req[word] = value
    seq = channel.seq + 1
    codec.publish_request(views, seq)
    channel.seq = seq
    if views.ctl[fp.CTL_SERVER_PARKED]:
        channel.sock.send(b"w")
    channel._wait(views, seq, "hostile", 10.0)
    return int(views.rep[fp.REP_CODE])


def test_hostile_register_many_records_are_refused_and_change_nothing(server_factory):
    server = server_factory(*POOL)
    with KVPoolClient(server.address) as client:
        seq = client.register()
        client.append(seq, 40, token_ids=np.arange(40, dtype=np.uint32))
        client.append(seq, 1, token_ids=[1])  # its two full blocks sealed
        channel = client._fast_channel
        before = client.stats()
        toks = list(range(30))
        cases = [
            dict(ids=[0, 0], counts=[10, 10], tokens=toks[:20]),  # one count a key length, not two
            dict(ids=[0, 0], counts=[10, 15, 0, 0], tokens=toks[:20]),  # token counts that do not sum
            dict(ids=[0, 0], counts=[10, 10, 0, 0], tokens=toks[:20],
                 header={fp.REQ_N_TOKENS: 10}),  # tokens fewer than the counts
            dict(ids=[2, 3], counts=[10, 10, 0, 0], tokens=toks[:20], extra=b"abcd"),  # keys past the extra bytes
            dict(ids=[(1 << 64) - 1, 1], counts=[10, 10, 0, 0], tokens=toks[:20], extra=b"a"),  # a sum that wraps
            dict(ids=[0, 0], counts=[(1 << 32) - 1, 21, 0, 0], tokens=toks[:20]),  # a huge count
            dict(ids=[0, 0], counts=[10, 10, 11, 0], tokens=toks[:20]),  # a public prefix past its prompt
            dict(ids=[0] * 9, counts=[1] * 9 + [0] * 9, tokens=toks[:9]),  # over --max-batch
            dict(ids=[], counts=[], tokens=[]),  # no prompt
            dict(ids=[0, 0], counts=[10, 10, 0, 0], tokens=toks[:20], header={fp.REQ_N_IDS: -1}),  # negative
            dict(ids=[0, 0], counts=[10, 10, 0, 0], tokens=toks[:20], header={fp.REQ_N_COUNTS: 1 << 40}),  # huge
            dict(ids=[0, 0], counts=[10, 10, 0, 0], tokens=toks[:20], header={fp.REQ_EXTRA_LEN: 1 << 20}),
        ]
        for case in cases:
            assert hostile(channel, **case) == INVALID_ARGUMENT, case
            after = client.stats()
            assert (after.num_sequences, after.num_blocks_used) == (before.num_sequences, before.num_blocks_used)
        # a long batch (hashed on the hasher) with a bad key after good prompts: refused, nothing applied
        long_tokens = list(range(3, 3 + 3000))
        code = hostile(channel, ids=[0, 300], counts=[1500, 1500, 0, 0], tokens=long_tokens, extra=b"x" * 300)
        assert code == INVALID_ARGUMENT and client.stats().num_sequences == before.num_sequences
        assert client.check_invariants().ok
        found = client.register_prompts([np.arange(40, dtype=np.uint32), np.arange(41, dtype=np.uint32)])
        assert client.fast_path_open and [r.num_cached_tokens for r in found] == [32, 32]  # still in step


def test_a_server_that_does_not_know_the_record_is_asked_over_grpc(monkeypatch):
    """A server of before the register-many record answers it INVALID_ARGUMENT "unknown op", unapplied: the client
    asks the same over gRPC, and from then on goes there at once (in-process: the server made to refuse the op)."""
    refusing_op(monkeypatch, fp.OP_REGISTER_MANY)
    with in_process_server() as handle:
        with KVPoolClient(f"127.0.0.1:{handle.port}", timeout=10) as client:
            client.free(client.register())
            calls = counting_grpc(client)
            published = int(client._fast_channel.views.ctl[fp.CTL_REQ_SEQ])
            prompts = [np.arange(40, dtype=np.uint32), np.arange(20, dtype=np.uint32)]
            assert [r.num_cached_tokens for r in client.register_prompts(prompts)] == [0, 0]
            assert calls == ["RegisterSequences"] and client.fast_path_open
            assert len(client.register_prompts(prompts)) == 2 and calls == ["RegisterSequences"] * 2
            assert int(client._fast_channel.views.ctl[fp.CTL_REQ_SEQ]) == published + 1  # asked once, then gRPC
            assert client.stats().num_sequences == 4


def test_the_asyncio_client_sends_the_record_with_the_same_answers_and_refusals(server_factory):
    from tests.client.blocking_aio import BlockingAsyncClient

    fast_server, grpc_server = server_factory(*POOL), server_factory(*POOL)
    fast = BlockingAsyncClient(fast_server.address)
    try:
        with KVPoolClient(grpc_server.address, fast_path=False) as slow:
            fast.register(), slow.register()
            assert refusals(fast) == refusals(slow)  # the record's error replies, thrown into the async plan
            assert workload(fast) == workload(slow)
            assert fast.fast_path_open
    finally:
        fast.close()


def test_the_record_carries_each_prompts_public_prefix_len(server_factory):
    """A prompt sealed with a public prefix of 64 tokens: a record asking for it with public_prefix_len 64 finds
    its blocks (the public ones and the tenant's after them), one with 0 (the tenant's salt from the first block)
    does not -- each prompt's own, in one record (written by hand: ``register_prompts`` sends 0 for each)."""
    server = server_factory(*POOL)
    with KVPoolClient(server.address) as client:
        prompt = np.arange(3, 3 + 100, dtype=np.uint32)
        seq, _ = client.register_prompt(prompt, public_prefix_len=64)
        client.append(seq, 100, token_ids=prompt)
        client.append(seq, 1, token_ids=[1])
        channel, before = client._fast_channel, client.stats().num_sequences
        code = hostile(channel, ids=[0, 0], counts=[100, 100, 64, 0], tokens=np.concatenate([prompt, prompt]))
        assert code == 0
        found = codec.read_registered_many_reply(channel.views)
        bs = client.block_table(seq).block_size
        assert [cached for _, cached, _ in found] == [96, 0]  # all but the last token's block
        assert found[0][2].tolist() == client.block_table(seq).block_ids[: 96 // bs].tolist()
        assert client.stats().num_sequences == before + 2 and client.check_invariants().ok
