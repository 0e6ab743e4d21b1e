"""One session's long registers do not hold up another session's requests (issue 30, item 16), against a real
server process, over both transports. The figure asserted is an order -- the server's sequence ids grow with the
order in which registers are applied -- never a timing."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import numpy as np

from kvpool import fastpath as fp
from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import KVPoolClient
from tests.service.service_helpers import connect

LONG = 1 << 20  # tokens: ~0.1 s of hashing on this machine, far longer than a cheap register's round trip
SERVER_ARGS = ("--max-seq-len", str(2 * LONG), "--fast-path-area-bytes", str(8 << 20),
               "--max-message-bytes", str(64 << 20))


def long_prompt(seed: int, size: int = LONG) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size, dtype=np.uint32)

@pytest.fixture
def gated_hashing(monkeypatch) -> threading.Event:  # noqa: ANN001
    """The hasher's chunks held until the returned gate is set (how fast the machine hashes decides nothing)."""
    from kvpool_server.service.prompt_hasher import HashJob

    gate, step = threading.Event(), HashJob.step

    def gated_step(job, num_blocks):  # noqa: ANN001, ANN202 -- the real step, once the gate is open
        gate.wait(60)
        step(job, num_blocks)

    monkeypatch.setattr(HashJob, "step", gated_step)
    return gate


def in_process_server(*flags: str):  # noqa: ANN201
    """A started server in this process (host backend, head size 1, an ephemeral TCP port): its hasher and fast
    path can be looked at and patched. ``stop`` it."""
    from kvpool_server.config import load_config
    from kvpool_server.grpc_api.server import build_server

    handle = build_server(load_config(["--backend", "host", "--head-dim", "1", "--address", "127.0.0.1:0", *flags]))
    handle.start()
    return handle


def stop(handle) -> None:  # noqa: ANN001
    handle.stop()
    handle.pool.close()



def test_fast_path_serves_another_session_while_a_long_register_is_hashed(server_factory) -> None:
    """The flooder's record is published first; the other session's register, published after it, is applied
    before it (the thread serves it while the long prompt is hashed off the thread)."""
    server = server_factory(*SERVER_ARGS)
    with KVPoolClient(server.address, lease_ttl_s=30.0) as flooder, \
            KVPoolClient(server.address, lease_ttl_s=30.0) as other:
        flooder.register()
        other.register()  # both channels open
        assert flooder.fast_path_open and other.fast_path_open
        ctl = flooder._fast_channel.views.ctl  # type: ignore[union-attr]
        published = int(ctl[fp.CTL_REQ_SEQ])
        result: list[int] = []
        flood = threading.Thread(target=lambda: result.append(flooder.register_prompt(long_prompt(1))[0]))
        flood.start()
        while int(ctl[fp.CTL_REQ_SEQ]) == published:  # the long register's record is published
            time.sleep(0.0005)
        other_id = other.register()
        flood.join(60)
        assert result, "the long register did not complete"
        assert other_id < result[0], ("the other session's register was applied after the long register that was "
                                      "published before it: the fast-path thread hashed the long prompt inline")
        assert flooder.fast_path_open and other.fast_path_open  # both went over their channels


def test_fast_path_serves_another_session_while_a_long_batch_of_prompts_is_hashed(server_factory) -> None:
    """The same for a register-many record (RegisterSequences of four prompts, LONG tokens in all): its prompts are
    hashed on the hasher, the other session's register, published after it, is applied before it."""
    server = server_factory(*SERVER_ARGS, "--max-tokens-per-call", str(2 * LONG))
    with KVPoolClient(server.address, lease_ttl_s=30.0) as flooder, \
            KVPoolClient(server.address, lease_ttl_s=30.0) as other:
        flooder.register()
        other.register()
        ctl = flooder._fast_channel.views.ctl  # type: ignore[union-attr]
        published = int(ctl[fp.CTL_REQ_SEQ])
        result: list[int] = []
        prompts = [long_prompt(i, LONG // 4) for i in range(4)]
        flood = threading.Thread(target=lambda: result.extend(r.seq_id for r in flooder.register_prompts(prompts)))
        flood.start()
        while int(ctl[fp.CTL_REQ_SEQ]) == published:  # the batch's record is published
            time.sleep(0.0005)
        other_id = other.register()
        flood.join(60)
        assert len(result) == 4, "the batch did not complete"
        assert int(ctl[fp.CTL_REQ_SEQ]) == published + 1  # one record, not gRPC
        assert other_id < min(result), ("the other session's register was applied after the batch published "
                                        "before it: the fast-path thread hashed the batch inline")
        assert flooder.fast_path_open and other.fast_path_open


def test_grpc_hashes_a_light_sessions_long_register_before_a_flooders_queued_ones(gated_hashing) -> None:
    """In-process, to see the hasher's queue: a flooder's 48 long registers have all reached the hasher and are
    queued (its hashing held at a gate until then: how fast the machine hashes does not decide what is queued);
    then another session's long register (128 blocks to hash) is submitted and the gate opened. The hasher takes
    the least-used session's job next, so it is applied before every queued one but the one being hashed. Without
    the fair share (the hasher first come, first served) it is applied after all of them. Ids give the order in
    which registers are applied."""
    gate = gated_hashing
    handle = in_process_server("--num-blocks", "256", *SERVER_ARGS)
    hasher, submitted = handle.service.hasher, []
    submit = hasher.submit

    def counted(key, *args, **kwargs):  # noqa: ANN001, ANN202 -- the real submit, counted
        job = submit(key, *args, **kwargs)
        submitted.append(key)
        return job

    hasher.submit = counted  # type: ignore[method-assign]
    try:
        address = f"127.0.0.1:{handle.port}"
        with connect(address) as stub, connect(address) as other:
            flood_session = stub.OpenSession(pb.OpenSessionRequest(client_name="flood")).session_id
            other_session = other.OpenSession(pb.OpenSessionRequest(client_name="other")).session_id
            request = pb.RegisterSequenceRequest(session_id=flood_session)
            request.prompt_token_ids.extend(long_prompt(2, LONG // 4).tolist())
            futures = [stub.RegisterSequence.future(request, timeout=120) for _ in range(48)]
            deadline = time.monotonic() + 120
            while len(submitted) < len(futures) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert len(submitted) == len(futures), "the flood's registers did not all reach the hasher"
            with hasher.cond:
                queued = len(hasher.jobs.get(flood_session, ()))  # the one being hashed among them
            assert queued >= 3, f"the hasher kept up with the flood ({queued} queued): the test tells nothing"
            light = pb.RegisterSequenceRequest(session_id=other_session)
            light.prompt_token_ids.extend(long_prompt(5, 2048 + 5).tolist())
            light_future = other.RegisterSequence.future(light, timeout=120)
            while len(submitted) < len(futures) + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert len(submitted) == len(futures) + 1, "the other session's register did not reach the hasher"
            gate.set()
            other_id = light_future.result().seq_id
            flood_ids = [f.result().seq_id for f in futures]
        after = sum(seq_id > other_id for seq_id in flood_ids)
        assert after >= queued - 2, (f"{after} of the {queued} flood registers queued before the other session's "
                                     "long register were applied after it: the hasher did not take the least-used "
                                     "session's job first")
    finally:
        gate.set()
        stop(handle)


def test_a_long_register_over_each_transport_matches_the_inline_hashes(server_factory) -> None:
    """Hashed on the hasher or inline, the same prompt finds the same cached blocks (the chain is the same)."""
    server = server_factory(*SERVER_ARGS)
    prompt = long_prompt(3, 2048 + 5)  # 128 blocks to hash: over CHUNK_BLOCKS
    with KVPoolClient(server.address, lease_ttl_s=30.0) as fast, \
            KVPoolClient(server.address, lease_ttl_s=30.0, fast_path=False) as slow:
        seq_id, cached = slow.register_prompt(prompt)
        assert cached == 0
        slow.append(seq_id, len(prompt), token_ids=prompt)
        slow.append(seq_id, 1, token_ids=[7])  # seals its full blocks: cached
        for client in (fast, slow):
            _, cached = client.register_prompt(prompt)
            assert cached == (len(prompt) - 1) // 16 * 16
        assert fast.fast_path_open


def test_a_long_prompt_register_refuses_is_refused_as_before(server_factory) -> None:
    server = server_factory("--max-seq-len", "4096")
    with connect(server.address) as stub:
        request = pb.RegisterSequenceRequest()
        request.prompt_token_ids.extend(long_prompt(4, 5000).tolist())
        try:
            stub.RegisterSequence(request, timeout=30)
            raise AssertionError("a prompt past --max-seq-len was accepted")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
        assert stub.Stats(pb.StatsRequest()).num_sequences == 0


def test_the_invariants_hold_while_long_registers_are_deferred_and_after() -> None:
    """In-process: the fast path's registry (a prepared record per deferred channel at most), the hasher's queue
    and the accountant's entries, looked at while two sessions' long registers are hashed, and once they end."""
    handle = in_process_server("--num-blocks", "256", "--max-seq-len", str(1 << 18))
    fast, service = handle.fast_path, handle.service
    assert fast is not None
    try:
        clients = [KVPoolClient(f"127.0.0.1:{handle.port}", lease_ttl_s=30.0) for _ in range(2)]
        threads = [threading.Thread(target=lambda c=c, i=i: [c.register_prompt(long_prompt(10 + i, 1 << 16))
                                                             for _ in range(3)]) for i, c in enumerate(clients)]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):  # the fast path's registry is checked between records: after
            service.hasher.check_invariants()
            service.fair.check_invariants()
        assert all(c.fast_path_open for c in clients)
        fast.check_invariants()
        for client in clients:
            client.close()
        fast.check_invariants()
        assert not fast.fair.prepared and service.hasher.queued_tokens == 0
    finally:
        stop(handle)


class Seat:
    """What the fast path's order reads of a channel: its session and tenant."""

    def __init__(self, session_id: int) -> None:
        self.session_id, self.tenant = session_id, None


def test_fast_path_order_is_round_robin_until_a_session_is_over_its_share() -> None:
    """FairChannels on a clock stepped by hand: a record's seconds are only added up on the thread (no lock) and
    folded into the accountant at the next pass ORDER_S later; while nobody is over its share the pass serves the
    channels as they are (the same list, whatever the usages); a session over its share has its channel served
    after the others'; once its usage decayed, round-robin again. Closing a channel folds its seconds."""
    from kvpool_server.config import ServerConfig
    from kvpool_server.fastpath.fair_channels import ORDER_S, FairChannels
    from kvpool_server.service.build import build_service
    from kvpool_server.service.fair_share import TAU_S, FairShare

    svc, _ = build_service(ServerConfig(backend="host", num_blocks=256, head_dim=1).validate())
    try:
        now = [100.0]
        svc.fair = FairShare(svc.guard.sessions, clock=lambda: now[0])
        fair = FairChannels(svc, lambda: None)
        flooder, light, lighter = (Seat(svc.guard.sessions.open().session_id) for _ in range(3))
        channels = [flooder, light, lighter]
        assert fair.order(channels) is channels
        fair.charge(light, 0.3 * TAU_S)  # less than the whole server together: nobody is over
        fair.charge(lighter, 0.1 * TAU_S)
        assert svc.fair.usage(light.session_id) == 0  # added up, not charged yet
        now[0] += 2 * ORDER_S
        assert fair.order(channels) is channels  # folded; nobody over: as given
        assert svc.fair.usage(light.session_id) > 0 and not fair.spent
        now[0] += 20 * TAU_S  # all decayed
        fair.charge(flooder, 0.99 * TAU_S)  # over what the others leave (0.95)
        fair.charge(light, 0.03 * TAU_S)
        fair.charge(lighter, 0.02 * TAU_S)
        now[0] += 2 * ORDER_S
        assert fair.order(channels) == [light, lighter, flooder]  # over its share: after the others
        assert fair.order(channels) == [light, lighter, flooder]  # the same until the next fold
        now[0] += 20 * TAU_S
        assert fair.order(channels) is channels  # decayed: round-robin again
        fair.charge(flooder, 0.01)
        fair.forget(flooder)  # closed: its seconds are charged now
        assert flooder not in fair.spent and svc.fair.usage(flooder.session_id) > 0
        fair.check_invariants(channels)
    finally:
        svc.hasher.stop()
        svc.guard.pool.close()


def test_grpc_register_sequences_of_a_long_batch_is_hashed_on_the_hasher_not_the_event_loop(gated_hashing) -> None:
    """In-process, to hold the hasher: a gRPC RegisterSequences of three prompts of 48 blocks each (over
    CHUNK_BLOCKS in all) queues one job a prompt on the hasher, whose hashing is held at a gate -- meanwhile the
    event loop answers another session's Stats and a short batch (hashed in the call, not queued). Then the gate
    opens and the long batch is answered with the cached run of a prompt the other session wrote; a batch with
    an empty prompt is refused with RegisterSequences' own status and queues nothing."""
    gate = gated_hashing
    handle = in_process_server("--num-blocks", "1024", "--block-size", "16")
    hasher, batches = handle.service.hasher, []
    submit_many = hasher.submit_many

    def counted(key, tenant, prompts, on_done):  # noqa: ANN001, ANN202 -- the real submit_many, counted
        batches.append(len(prompts))
        return submit_many(key, tenant, prompts, on_done)

    hasher.submit_many = counted  # type: ignore[method-assign]
    try:
        address = f"127.0.0.1:{handle.port}"
        with connect(address) as stub, connect(address) as other:
            session = stub.OpenSession(pb.OpenSessionRequest(client_name="long")).session_id
            other_session = other.OpenSession(pb.OpenSessionRequest(client_name="short")).session_id
            shared = long_prompt(7, 48 * 16 + 1)
            seq = other.RegisterSequence(pb.RegisterSequenceRequest(session_id=other_session), timeout=30).seq_id
            append = pb.AppendTokenRequest(session_id=other_session, seq_ids=[seq], num_tokens=[len(shared)])
            append.token_ids.extend(shared.tolist())
            other.AppendToken(append, timeout=30)
            other.AppendToken(pb.AppendTokenRequest(session_id=other_session, seq_ids=[seq], num_tokens=[1],
                                                    token_ids=[2]), timeout=30)

            def batch(session_id: int, *prompts: np.ndarray) -> pb.RegisterSequencesRequest:
                request = pb.RegisterSequencesRequest(session_id=session_id)
                for p in prompts:
                    request.prompts.add().prompt_token_ids.extend(p.tolist())
                return request

            # the writer's 769 tokens, 48 blocks sealed: the long batch's first prompt is the same tokens
            future = stub.RegisterSequences.future(batch(session, shared, long_prompt(8, 48 * 16 + 1),
                                                         long_prompt(9, 48 * 16 + 1)), timeout=120)
            deadline = time.monotonic() + 60
            while not batches and time.monotonic() < deadline:
                time.sleep(0.005)
            assert batches == [3], "the long batch did not reach the hasher"
            assert not future.done()
            assert other.Stats(pb.StatsRequest(), timeout=10).num_sequences >= 1  # the loop is free meanwhile
            short = other.RegisterSequences(batch(other_session, long_prompt(10, 40), long_prompt(11, 40)), timeout=10)
            assert len(short.sequences) == 2 and batches == [3], "a short batch went to the hasher"
            with pytest.raises(grpc.RpcError) as refused:
                other.RegisterSequences(batch(other_session, long_prompt(12, 48 * 16), np.zeros(0, np.uint32)),
                                        timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and batches == [3]
            gate.set()
            answer = future.result()
            assert [s.num_cached_tokens for s in answer.sequences] == [48 * 16, 0, 0]  # the writer's 48 blocks
        handle.service.guard.manager.check_invariants()  # raises on a broken invariant
    finally:
        gate.set()
        stop(handle)
