"""attach() on the host backend: the pool mapped without a copy, shared with the server and other processes."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvpool_client import InvalidArgumentError, KVPoolClient
from kvpool_client.loadgen.pattern import kv_pattern, token_keys

BS = 16


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
