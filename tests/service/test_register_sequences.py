"""RegisterSequences against a real server process: one call registers many prompts exactly as that many
RegisterSequence calls would (the same cached tokens, the block ids GetBlockTable answers), all or none, within
its bounds (--max-batch prompts, --max-tokens-per-call tokens)."""

from __future__ import annotations

import grpc
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import InvalidArgumentError, KVPoolClient, ResourceExhaustedError
from tests.security.tenant_helpers import As, write_tokens

BS = 16


def cached_prompt(client: KVPoolClient, tokens: list[int]) -> None:
    """A frontend's prefill of ``tokens``: appended with their ids, then sealed by one more token, then freed."""
    seq, cached = client.register_prompt(tokens)
    client.append([seq], len(tokens) - cached, token_ids=tokens[cached:])
    client.append([seq], 1, token_ids=[1])
    client.free(seq)


def test_a_batch_registers_what_single_registers_would(server_factory):
    server = server_factory("--num-blocks", "256", "--block-size", str(BS), unix=True)
    with KVPoolClient(server.address) as client:
        first, second = list(range(3, 3 + 5 * BS)), list(range(200, 200 + 3 * BS))
        cached_prompt(client, first)
        cached_prompt(client, second)
        prompts = [first + [7] * 9, second[: 2 * BS + 1], [9] * (2 * BS), first]
        got = client.register_prompts(prompts, cache_extra_keys=[b""] * 4)
        assert [g.num_cached_tokens for g in got] == [5 * BS, 2 * BS, 0, 4 * BS]  # all but one token, at most
        for g in got:
            table = client.block_table(g.seq_id)
            assert table.num_tokens == g.num_cached_tokens
            assert g.cached_block_ids.tolist() == table.block_ids[: g.num_cached_tokens // BS].tolist()
        singles = [client.register_prompt(p) for p in prompts]
        assert [n for _, n in singles] == [g.num_cached_tokens for g in got]
        assert client.stats().num_sequences == 8
        keyed = client.register_prompts([first + [7]], cache_extra_keys=[b"lora-x"])
        assert keyed[0].num_cached_tokens == 0  # another key, other blocks
    with KVPoolClient(server.address) as client:
        assert client.stats().num_sequences == 0  # the session's sequences went with it
        assert client.check_invariants().ok


def test_one_bad_prompt_refuses_the_whole_batch_and_changes_nothing(server_factory):
    server = server_factory("--num-blocks", "256", "--block-size", str(BS), "--max-seq-len", "256",
                            "--max-batch", "4", "--max-tokens-per-call", "600", unix=True)
    with KVPoolClient(server.address) as client:
        cached_prompt(client, list(range(3, 3 + 4 * BS)))
        before = client.stats()
        good = list(range(3, 3 + 4 * BS)) + [5]
        cases = {
            "prompts[1]: prompt_token_ids has 257 tokens, over max_seq_len=256": [good, [4] * 257],
            "prompts[1]: cache_extra_key": None,  # a key over its bound
            "at most max_batch=4 prompts": [good] * 5,
            "--max-tokens-per-call=600": [[3] * 200] * 4,
            "has no prompt_token_ids": [good, []],
        }
        for why, prompts in cases.items():
            keys: list[bytes] = []
            if prompts is None:
                prompts, keys = [good, good], [b"", b"k" * 257]
            with pytest.raises(InvalidArgumentError) as err:
                client.register_prompts(prompts, cache_extra_keys=keys)
            assert why in str(err.value), (why, str(err.value))
        after = client.stats()
        assert after.num_sequences == 0 and after.num_blocks_used == before.num_blocks_used
        assert after.prefix_query_tokens == before.prefix_query_tokens  # no prompt of a refused batch looked up
        assert client.check_invariants().ok


def test_a_tenants_max_sequences_refuses_the_batch_whole(server_factory, tmp_path):
    tokens = write_tokens(tmp_path / "t.toml", tenants="[tenants.a]\nmax_sequences = 3\n")
    server = server_factory("--num-blocks", "256", "--block-size", str(BS), "--auth-tokens", str(tokens))
    with grpc.insecure_channel(server.address) as channel:
        a = As(channel, "tok-a")
        a.RegisterSequence(pb.RegisterSequenceRequest())
        prompts = [pb.SequencePrompt(prompt_token_ids=[i] * 40) for i in range(3)]
        with pytest.raises(grpc.RpcError) as err:
            a.RegisterSequences(pb.RegisterSequencesRequest(prompts=prompts))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sequences=3" in err.value.details()
        assert a.Stats(pb.StatsRequest()).tenants[0].num_sequences == 1  # nothing of the batch registered
        reply = a.RegisterSequences(pb.RegisterSequencesRequest(prompts=prompts[:2]))
        assert len(reply.sequences) == 2 and len({s.seq_id for s in reply.sequences}) == 2
        assert a.Stats(pb.StatsRequest()).tenants[0].num_sequences == 3
        # a retry of the same request id is answered with the first answer, applied once
        session = a.OpenSession(pb.OpenSessionRequest()).session_id
        a.Free(pb.FreeRequest(seq_ids=[s.seq_id for s in reply.sequences]))
        request = pb.RegisterSequencesRequest(prompts=prompts[:1], session_id=session, request_id=7)
        once, again = a.RegisterSequences(request), a.RegisterSequences(request)
        assert once == again and a.Stats(pb.StatsRequest()).tenants[0].num_sequences == 2


@pytest.mark.parametrize("fast_path", [False, True])
def test_the_servers_max_num_seqs_reached_mid_batch_refuses_it_whole(server_factory, fast_path):
    """The core's register_many refuses the burst where its third register would exceed --max-num-seqs: nothing of it
    registered, over gRPC and over the fast path's register-many record alike; a batch that fits is then served."""
    server = server_factory("--num-blocks", "256", "--block-size", str(BS), "--max-num-seqs", "4", unix=True)
    with KVPoolClient(server.address, fast_path=fast_path) as client:
        client.register_prompts([[1] * 20, [2] * 20])  # opens the fast path's channel (when on)
        assert client.fast_path_open == fast_path
        with pytest.raises(ResourceExhaustedError, match="max_num_seqs=4"):
            client.register_prompts([[3] * 20, [4] * 20, [5] * 20])
        assert client.stats().num_sequences == 2 and client.check_invariants().ok
        assert len(client.register_prompts([[3] * 20, [4] * 20])) == 2
        assert client.stats().num_sequences == 4
