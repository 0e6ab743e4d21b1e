"""build_server (grpc_api/server.py): binds without starting; every RPC of the proto gets a handler of its kind."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.v1 import kvpool_pb2
from kvpool_server.config import ServerConfig
from kvpool_server.grpc_api.methods import RPCS, BidiStream, ServerStream, Unary
from kvpool_server.grpc_api.server import build_server


def test_build_server_binds_but_does_not_start_until_start() -> None:
    config = ServerConfig(address="127.0.0.1:0", backend="host", num_blocks=16).validate()
    handle = build_server(config)
    try:
        assert handle.port and not handle.pool.closed and not handle.admission.draining
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError):  # bound (the port is ours) but nobody answers yet
                health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            handle.start()
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        handle.stop()
        handle.pool.close()


def test_every_rpc_of_the_proto_is_in_the_table_with_its_kind() -> None:
    service = kvpool_pb2.DESCRIPTOR.services_by_name["KVPoolService"]
    kinds = {(False, False): Unary, (True, True): BidiStream, (False, True): ServerStream}
    assert set(RPCS) == set(service.methods_by_name)
    for name, method in service.methods_by_name.items():
        assert isinstance(RPCS[name], kinds[(method.client_streaming, method.server_streaming)]), name
        assert RPCS[name].request_cls.DESCRIPTOR is method.input_type, name
