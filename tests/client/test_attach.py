"""attach() on the host backend: the pool mapped without a copy, shared with the server and other processes."""

from __future__ import annotations

import multiprocessing as mp
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import InvalidArgumentError, KVPoolClient, SessionLostError
from kvpool_client.session import SessionState
from kvpool_client.loadgen.pattern import kv_pattern, token_keys

BS = 16


def wait_for(predicate, timeout: float, step: float = 0.005) -> None:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s")
        time.sleep(step)


def _write_through_attach(target: str, num_tokens: int, out: mp.Queue) -> None:
    """In a spawned process: register a sequence, append, write its KV only through the attached pool. Without a
    session, so that the sequence outlives this process."""
    with KVPoolClient(target, session=False) as client:
        seq = client.register()
        result = client.append(seq, num_tokens)
        pool = client.attach()
        pool.write_slots(result.slot_mapping, kv_pattern(token_keys(seq, 0, num_tokens), pool.layout))
        out.put(seq)
    # The client (and its mapping) is closed; the sequence and its KV stay on the server.


def _has_gpu() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001  (no CuPy, no driver: no GPU)
        return False


@pytest.mark.parametrize(
    "backend", ["host", pytest.param("gpu", marks=pytest.mark.skipif(not _has_gpu(), reason="no GPU"))]
)
def test_kv_written_through_attach_in_one_process_reads_back_through_readkv_in_another(server_factory, backend):
    server = server_factory("--backend", backend, "--pool-bytes", "2MiB")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_write_through_attach, args=(server.address, 37, out))
    proc.start()
    seq = out.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    with KVPoolClient(server.address) as client:
        expected = kv_pattern(token_keys(seq, 0, 37), client.layout)
        assert np.array_equal(client.read_kv(seq), expected)
        # And the other way round: this process's own mapping sees the same bytes, through the page table.
        with client.attach() as pool:
            assert pool.backend == backend
            assert np.array_equal(pool.read_slots(client.block_table(seq).slots()), expected)
            # Copy-on-write on the server's device: a fork's append copies the shared last block first.
            (child,) = client.fork(seq, 1)
            result = client.append(child, 1)
            assert result.copies.shape == (1, 2)
            pool.write_slots(result.slot_mapping, kv_pattern(token_keys(child, 37, 38), pool.layout))
            child_kv = np.concatenate([expected, kv_pattern(token_keys(child, 37, 38), pool.layout)])
            assert np.array_equal(client.read_kv(child), child_kv)
            assert np.array_equal(client.read_kv(seq), expected)  # the parent's block is untouched
        client.free([seq, child])


def test_views_are_zero_copy(server):
    with KVPoolClient(server.address) as client, client.attach() as pool:
        desc = client.describe_pool()
        assert pool.blocks.shape == (desc.num_blocks, 1, 2, BS, 1, 64)
        assert pool.backend == "host" and isinstance(pool.blocks, np.ndarray)
        k, v = pool.layer_kv(0)
        assert k.shape == v.shape == (desc.num_blocks, BS, 1, 64)
        assert np.shares_memory(k, pool.blocks) and np.shares_memory(v, pool.blocks)
        seq = client.register()
        (slot,) = client.append(seq, 1).slot_mapping
        block_id, offset = divmod(int(slot), BS)
        k[block_id, offset] = 1.5  # write through the per-layer view...
        v[block_id, offset] = -2.0
        token = client.read_kv(seq)[0]  # ...and the server reads it from the same memory
        assert (token[0, 0] == 1.5).all() and (token[0, 1] == -2.0).all()
        with pytest.raises(IndexError):
            pool.layer_kv(1)
        client.free(seq)


def test_write_and_read_slots_check_their_input(server):
    with KVPoolClient(server.address) as client:
        pool = client.attach()
        limit = pool.num_blocks * BS
        good = np.zeros((2, 1, 2, 1, 64), np.float32)
        with pytest.raises(InvalidArgumentError):
            pool.write_slots([0, limit], good)  # a slot past the pool
        with pytest.raises(InvalidArgumentError):
            pool.write_slots([0], good)  # 2 tokens of data for 1 slot
        with pytest.raises(InvalidArgumentError):
            pool.write_slots([0, 1], good.astype(np.float16))
        with pytest.raises(InvalidArgumentError):
            pool.read_slots([-1])
    assert pool.closed  # closing the client closed its attached pool
    with pytest.raises(ValueError):
        _ = pool.blocks


def test_client_imports_and_attaches_without_cupy(server):
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["cupy"] = None  # any `import cupy` now raises ImportError
        from kvpool_client import KVPoolClient
        with KVPoolClient({server.address!r}) as client:
            pool = client.attach()
            print(pool.backend, pool.blocks.shape[0])
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "host"


_STOPPED_WRITER = textwrap.dedent(
    """
    import sys
    from kvpool_client import KVPoolClient, KVPoolClientError
    from kvpool_client.loadgen.pattern import kv_pattern, token_keys

    client = KVPoolClient(sys.argv[1], lease_ttl_s=float(sys.argv[2]))
    seq = client.register()
    slots = client.append(seq, 20).slot_mapping
    pool = client.attach()
    data = kv_pattern(token_keys(seq, 0, 20), pool.layout)
    pool.write_slots(slots, data)
    print("READY", flush=True)
    sys.stdin.readline()  # the line is already there when this process is continued: it writes at once
    try:
        pool.write_slots(slots, data)
        print("APPLIED", flush=True)
    except KVPoolClientError as error:
        print("REFUSED", type(error).__name__, flush=True)
    """
)


def test_a_frontend_continued_after_its_lease_refuses_its_first_attached_write(server):
    """Issue 20 item 5: SIGSTOP for longer than the lease, SIGCONT: the first attached write is refused locally,
    before the keep-alive could learn that the session is gone (and the blocks freed and taken by another)."""
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_WRITER, server.address, "1.0"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        with KVPoolClient(server.address) as observer:
            proc.send_signal(signal.SIGSTOP)
            wait_for(lambda: observer.stats().num_blocks_used == 0, timeout=10.0, step=0.05)  # the lease ran out
            other = observer.register()
            observer.append(other, 256 * BS - 16)  # another sequence takes the freed blocks (all but one)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            proc.send_signal(signal.SIGCONT)
            assert proc.stdout.readline().split() == ["REFUSED", "SessionLostError"]
            expected = kv_pattern(token_keys(other, 0, 20), observer.layout)
            observer.write_kv(other, 0, expected)
            assert np.array_equal(observer.read_kv(other)[:20], expected)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_attached_writes_and_reads_refuse_once_nothing_was_acknowledged_within_the_lease(server):
    """The heartbeat stops (its thread ended: the server ends the session), the process runs on: once the lease
    (less the margin) has passed since the last acknowledged request, the attached pool refuses, though
    the keep-alive never reported the session lost."""
    with KVPoolClient(server.address, lease_ttl_s=1.0) as client:
        seq = client.register()
        slots = client.append(seq, 20).slot_mapping
        pool = client.attach()
        data = kv_pattern(token_keys(seq, 0, 20), pool.layout)
        time.sleep(1.5)  # heartbeats keep a live session: no refusal after more than the lease
        pool.write_slots(slots, data)
        assert np.array_equal(pool.read_slots(slots), data)
        client._keep_alive.stop()
        wait_for(lambda: client._session.last_ack is not None
                 and time.monotonic() - client._session.last_ack > 1.0, timeout=5.0, step=0.05)
        assert client.server_lost is None  # the keep-alive did not notice anything
        with pytest.raises(SessionLostError, match="acknowledged nothing of session"):
            pool.write_slots(slots, data)
        with pytest.raises(SessionLostError):
            pool.write_layer(0, slots, data[:, 0, 0], data[:, 0, 1])
        with pytest.raises(SessionLostError):
            pool.read_slots(slots)
        with pytest.raises(SessionLostError):
            pool.read_layer(0, slots)


def test_the_lease_check_refuses_a_margin_before_the_lease_and_only_with_a_session():
    state = SessionState(True, "t", None)
    state.check_lease("write")  # not opened yet: nothing to check
    state.opened(pb.OpenSessionResponse(session_id=7, lease_ttl_ms=10_000), sent_at=time.monotonic() - 8.9)
    state.check_lease("write")
    state.acked(time.monotonic() - 9.1)  # older than what is known: ignored
    state.check_lease("write")
    state.last_ack = time.monotonic() - 9.1  # within the margin (1 s of a 10 s lease)
    with pytest.raises(SessionLostError, match="refused 1 s early"):
        state.check_lease("write")
    off = SessionState(False, "t", None)
    off.last_ack, off.lease_ttl_s = 0.0, 1.0
    off.check_lease("write")
