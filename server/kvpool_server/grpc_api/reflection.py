"""Server reflection as ``grpc.reflection.v1alpha`` (grpcio-reflection's) and ``grpc.reflection.v1``."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from kvpool.v1 import kvpool_pb2

SERVICE_NAME = kvpool_pb2.DESCRIPTOR.services_by_name["KVPoolService"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def add_reflection(server: grpc.aio.Server) -> None:
    """Server reflection as ``grpc.reflection.v1alpha`` (grpcio-reflection's) and ``grpc.reflection.v1`` (the same
    messages under the v1 names: one servicer, a second handler; the v1 file is added to the descriptor pool so that
    the v1 service can describe itself too)."""
    _register_v1_reflection_descriptor()
    names = (SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }),))


def _register_v1_reflection_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    for message in proto.message_type:
        for f in message.field:
            f.type_name = f.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    try:
        pool.AddSerializedFile(proto.SerializeToString())
    except Exception:  # another copy of the v1 file (another library's) got there first: fine, it is the same
        pass
