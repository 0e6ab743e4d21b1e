"""Load for the hardening tests, run as its own process (``python -m tests.service.load_worker MODE ADDRESS ...``)
so that its client threads do not share the test's GIL. Prints ``ready`` once the load is on, then a result line.

  streams ADDRESS IDLE STALLED BUSY SECONDS   IDLE streams that send one message and wait, STALLED streams that
                                              send and never read, BUSY streams doing 64-sequence steps back to back
  check-loop ADDRESS SECONDS                  CheckInvariants back to back; prints the number of calls
  hold-stream ADDRESS                         one AppendTokenStream with one message answered, then sleep (the test
                                              SIGKILLs this process)
"""

from __future__ import annotations

import asyncio
import sys
import time

import grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc


async def streams(address: str, num_idle: int, num_stalled: int, num_busy: int, seconds: float) -> None:
    channels = [grpc.aio.insecure_channel(address) for _ in range(1 + (num_idle + num_stalled + num_busy) // 50)]
    stubs = [pb_grpc.KVPoolServiceStub(c) for c in channels]
    stub = stubs[0]
    seq_ids = [(await stub.RegisterSequence(pb.RegisterSequenceRequest())).seq_id for _ in range(64)]
    calls = []
    for i in range(num_idle):
        call = stubs[i % len(stubs)].AppendTokenStream()
        await call.write(pb.AppendTokenStreamRequest(seq_ids=seq_ids[:1]))
        await call.read()
        calls.append(call)
    big = pb.AppendTokenStreamRequest(seq_ids=seq_ids, num_tokens=[16])
    for i in range(num_stalled):  # send enough that the replies fill the flow-control window; never read
        call = stubs[i % len(stubs)].AppendTokenStream()
        calls.append(call)

        async def flood(call: grpc.aio.StreamStreamCall = call) -> None:
            try:
                for _ in range(200):
                    await call.write(big)
            except Exception:
                pass

        asyncio.get_running_loop().create_task(flood())
    steps = [0]

    async def busy(stub: pb_grpc.KVPoolServiceStub) -> None:
        ids = [(await stub.RegisterSequence(pb.RegisterSequenceRequest())).seq_id for _ in range(64)]
        call = stub.AppendTokenStream()
        step = pb.AppendTokenStreamRequest(seq_ids=ids)
        n = 0
        while True:
            await call.write(step)
            await call.read()
            n += 1
            steps[0] += 1
            if n == 500:  # stay far from max_seq_len
                await call.done_writing()
                await stub.Free(pb.FreeRequest(seq_ids=ids))
                ids = [(await stub.RegisterSequence(pb.RegisterSequenceRequest())).seq_id for _ in range(64)]
                call, step, n = stub.AppendTokenStream(), pb.AppendTokenStreamRequest(seq_ids=ids), 0

    tasks = [asyncio.get_running_loop().create_task(busy(stubs[i % len(stubs)])) for i in range(num_busy)]
    await asyncio.sleep(0.5)
    print("ready", flush=True)
    await asyncio.sleep(seconds)
    print(f"busy steps {steps[0]}", flush=True)
    for task in tasks:
        task.cancel()
    for call in calls:
        call.cancel()
    for channel in channels:
        await channel.close(None)


def check_loop(address: str, seconds: float) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.KVPoolServiceStub(channel)
        stub.CheckInvariants(pb.CheckInvariantsRequest(), timeout=30)
        print("ready", flush=True)
        end, n = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            stub.CheckInvariants(pb.CheckInvariantsRequest(), timeout=30)
            n += 1
        print(f"checks {n}", flush=True)


def hold_stream(address: str) -> None:
    import queue

    channel = grpc.insecure_channel(address)
    stub = pb_grpc.KVPoolServiceStub(channel)
    seq_id = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
    requests: queue.SimpleQueue = queue.SimpleQueue()
    responses = stub.AppendTokenStream(iter(requests.get, None))
    requests.put(pb.AppendTokenStreamRequest(seq_ids=[seq_id]))
    next(responses)
    print("ready", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    mode, address, *rest = sys.argv[1:]
    if mode == "streams":
        asyncio.run(streams(address, int(rest[0]), int(rest[1]), int(rest[2]), float(rest[3])))
    elif mode == "check-loop":
        check_loop(address, float(rest[0]))
    else:
        hold_stream(address)
