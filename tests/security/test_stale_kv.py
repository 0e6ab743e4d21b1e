"""Freed KV never reaches the next owner (issue 20.1): a block that changes hands is cleared on the pool before the
append that hands it out answers, so a tenant that appends and reads before writing reads zeros, not another
tenant's KV -- through ReadKV and through the mapped pool. Real server processes."""

from __future__ import annotations

import grpc
import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from tests.security.tenant_helpers import As, write_tokens


def test_a_tenant_never_reads_the_kv_another_tenant_freed(server_factory, tmp_path):
    tokens = write_tokens(tmp_path / "tokens.toml")
    server = server_factory("--auth-tokens", str(tokens), "--num-blocks", "8")
    with grpc.insecure_channel(server.address) as channel:
        a, b = As(channel, "tok-a"), As(channel, "tok-b")
        token_bytes = a.DescribePool(pb.DescribePoolRequest()).layout.token_bytes
        secret = (np.arange(40 * token_bytes // 4, dtype=np.float32) + 1).tobytes()
        victims = []
        for _ in range(2):  # the whole pool (8 blocks of 16 tokens) written by tenant a, then freed
            seq = a.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
            a.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[64]))
            a.WriteKV(pb.WriteKVRequest(seq_id=seq, data=secret[: 40 * token_bytes] + secret[: 24 * token_bytes]))
            victims.append(seq)
        a.Free(pb.FreeRequest(seq_ids=victims))

        seq = b.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        reply = b.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[128]))  # every block of the pool
        assert len(reply.new_block_ids) == 8
        data = b.ReadKV(pb.ReadKVRequest(seq_id=seq, num_tokens=128)).data
        assert len(data) == 128 * token_bytes
        assert not any(data), f"{sum(1 for i in range(128) if any(data[i * token_bytes:(i + 1) * token_bytes]))} " \
                              "of 128 tokens read back another tenant's freed KV"
