"""The server's /dev/shm segments against real server processes: every page reserved when the segment is made (the
pool at start, a channel at OpenFastPath), a /dev/shm without room refused with a status (never SIGBUS), and the
segments of a server killed with its whole process group -- pool and pending channels -- reaped at the next start.

The tests that fill /dev/shm or kill servers run in a 64 MiB /dev/shm of their own (``private_shm``: root only), so
that neither the machine's /dev/shm nor other servers' start-up sweeps come into it.
"""

from __future__ import annotations

import os
import signal
import sys

import grpc
import pytest

from kvpool import fastpath as fp
from kvpool.v1 import kvpool_pb2 as pb
from tests.service.service_helpers import connect

MiB = 1 << 20
TOKEN_BYTES = 512  # the seed layout's (a block: 16 tokens, 8 KiB)


def allocated_bytes(path: str) -> int:
    return os.stat(path).st_blocks * 512


def open_channel(stub) -> pb.OpenFastPathResponse:
    session = stub.OpenSession(pb.OpenSessionRequest(client_name="shm-test", lease_ttl_ms=60_000))
    return stub.OpenFastPath(pb.OpenFastPathRequest(session_id=session.session_id))


def fill(path: str) -> None:
    """Write every byte of the file, as a client may write its segment (with write(2): a full tmpfs answers ENOSPC
    here, where a store through a mapping would be SIGBUS in the test)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        size, chunk = os.fstat(fd).st_size, b"\xab" * MiB
        for offset in range(0, size, len(chunk)):
            try:
                os.pwrite(fd, chunk[: size - offset], offset)
            except OSError:  # ENOSPC: the tmpfs is full
                return
    finally:
        os.close(fd)


def test_the_pool_segment_is_backed_in_full_at_start(server_factory) -> None:
    server = server_factory("--pool-bytes", "8MiB")
    with connect(server.address) as stub:
        described = stub.DescribePool(pb.DescribePoolRequest())
    assert described.pool_bytes == 8 * MiB
    assert allocated_bytes(f"/dev/shm/{described.shm_name}") >= described.pool_bytes, "the pool is sparse"


def test_a_channel_segment_is_backed_in_full_and_named_by_its_owner(server_factory) -> None:
    server = server_factory()
    with connect(server.address) as stub:
        channel = open_channel(stub)
    path = f"/dev/shm/{channel.shm_name}"
    assert allocated_bytes(path) >= channel.segment_bytes == fp.segment_bytes(channel.area_bytes), "sparse"
    pid, start_time = channel.shm_name.split("-")[2:4]
    assert int(pid) == server.pid
    assert int(start_time) == int(open(f"/proc/{server.pid}/stat").read().rsplit(")", 1)[1].split()[19])


def test_channels_that_fill_dev_shm_are_refused_and_write_kv_never_sigbus(private_shm, server_factory) -> None:
    """Issue 30 item 2: a 64 MiB /dev/shm, a 48 MiB pool, channels whose clients write their segments whole: their
    writes filled it and the next WriteKV killed the server with SIGBUS (exit 135)."""
    server = server_factory("--pool-bytes", "48MiB", prefix=private_shm.prefix)
    refused = None
    with connect(server.address) as stub:
        for _ in range(40):  # 40 channels of 2 MiB: more than the 64 MiB /dev/shm, pool or no pool
            try:
                channel = open_channel(stub)
            except grpc.RpcError as exc:
                refused = exc
                break
            fill(f"{private_shm.path}/{channel.shm_name}")
        try:
            session = stub.OpenSession(pb.OpenSessionRequest(client_name="writer", lease_ttl_ms=60_000)).session_id
            seq = stub.RegisterSequence(pb.RegisterSequenceRequest(session_id=session)).seq_id
            stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[256], session_id=session))
            stub.WriteKV(pb.WriteKVRequest(seq_id=seq, session_id=session, start_position=0,
                                           data=b"\x01" * (256 * TOKEN_BYTES)), timeout=30)
        except grpc.RpcError as exc:
            server.proc.wait(5)
            pytest.fail(f"{exc.code()}: {exc.details()}; the server exited with {server.proc.returncode}")
        assert server.proc.poll() is None
    assert refused is not None, "40 channels of 2 MiB fitted a 64 MiB /dev/shm beside a 48 MiB pool"
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "/dev/shm" in refused.details() and "use gRPC" in refused.details()
    assert not [n for n in private_shm.names() if n.startswith("kvpool-fp-") and
                allocated_bytes(f"{private_shm.path}/{n}") < fp.segment_bytes(channel.area_bytes)]


POOL_IN_FULL_SHM = r"""
import sys
from kvpool.layout import KVLayout
from kvpool_server.device.host_pool import HostPool
from kvpool_server.shm_segments import ShmFullError
with open("/dev/shm/filler", "wb") as f:
    f.write(bytes(40 << 20))
try:
    HostPool(KVLayout(), (48 << 20) // KVLayout().block_bytes)
except ShmFullError as exc:
    print("refused:", exc)
"""


def test_a_pool_that_does_not_fit_the_free_space_fails_where_it_is_made(private_shm) -> None:
    """The start-up check reads the free space before the pool is made; whatever takes it meanwhile, the pool's
    reservation fails with a message (and leaves no segment), not a write later with SIGBUS."""
    done = private_shm.run(sys.executable, "-c", POOL_IN_FULL_SHM)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "/dev/shm" in done.stdout and "48MiB" in done.stdout, done.stdout
    assert private_shm.names() == {"filler"}


def test_kill_9_of_the_group_leaves_no_pending_channel_past_the_next_start(private_shm, server_factory) -> None:
    """Issue 30 item 9: the pending channels (``kvpool-fp-*``) of a server killed with its process group stayed in
    /dev/shm for good."""
    first = server_factory(prefix=private_shm.prefix)
    with connect(first.address) as stub:
        names = {open_channel(stub).shm_name for _ in range(3)}
    assert names <= private_shm.names()
    os.killpg(os.getpgid(first.pid), signal.SIGKILL)  # the server and its resource_tracker at once
    first.proc.wait()
    assert names <= private_shm.names(), "nothing was left: the test proves nothing"
    second = server_factory(prefix=private_shm.prefix)
    assert not names & private_shm.names(), "the dead server's channels outlived the next start"
    assert "left by dead servers" in second.log()


def test_the_sweep_takes_only_kvpool_segments_of_dead_owners_of_this_pid_namespace(tmp_path) -> None:
    from kvpool_server.shm_segments import pid_namespace, process_start_time, reap_stale_segments

    ns, me, start, init = pid_namespace(), os.getpid(), process_start_time(), process_start_time(1)
    with open("/proc/sys/kernel/pid_max") as f:
        dead_pid = int(f.read())  # pids are below pid_max: no such process
    names = {
        f"kvpool-{dead_pid}-5-{ns}-aa": True, f"kvpool-fp-{dead_pid}-5-{ns}-bb": True,  # dead: reaped
        f"kvpool-{me}-{start + 1}-{ns}-cc": True,  # our pid, another start time: a dead server whose pid we reuse
        f"kvpool-{me}-{start}-{ns}-dd": False, f"kvpool-fp-1-{init}-{ns}-ee": False,  # alive
        f"kvpool-{dead_pid}-5-{ns + 1}-ff": False,  # another pid namespace: its pids mean nothing here
        f"kvpool-fp-{dead_pid}-0a1b2c3d4e5f": False, "kvpool-x-1-2-3-aa": False, "other": False,  # not ours
    }
    for name in names:
        (tmp_path / name).write_bytes(b"")
    reaped = reap_stale_segments(str(tmp_path))
    assert sorted(reaped) == sorted(name for name, dead in names.items() if dead)
    assert set(os.listdir(tmp_path)) == {name for name, dead in names.items() if not dead}
