"""The dlite.v1.DLiteService registration for Serve's gRPC proxy (`grpc_servicer_functions`).

The generated `add_DLiteServiceServicer_to_server` decodes requests with `FromString`, in
the proxy: a message it cannot decode (a string field that is not UTF-8, a truncated
message) fails there and reaches the client as UNKNOWN, before the ingress could answer.
This registration decodes the same messages, but hands an undecodable one on as a
`MalformedRequest`, which the ingress refuses as INVALID_ARGUMENT (request_limits).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from dlite_ray.serve.proto import dlite_pb2

SERVICE = dlite_pb2.DESCRIPTOR.services_by_name["DLiteService"]


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    """What the proxy passes on for bytes that are not a valid request message."""

    reason: str


def add_DLiteServiceServicer_to_server(servicer, server) -> None:
    handlers = {}
    for method in SERVICE.methods:
        request_cls = getattr(dlite_pb2, method.input_type.name)
        response_cls = getattr(dlite_pb2, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=lenient(request_cls),
                                     response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.62 (as the generated code does)
        server.add_registered_method_handlers(SERVICE.full_name, handlers)


def lenient(request_cls):
    """`request_cls.FromString`, or a MalformedRequest naming what was wrong."""
    def decode(raw: bytes):
        try:
            return request_cls.FromString(raw)
        except DecodeError as exc:
            return MalformedRequest(f"the request is not a valid {request_cls.DESCRIPTOR.full_name} message "
                                    f"({_reason(exc)})")
    return decode


def _reason(exc: DecodeError) -> str:
    text = str(exc)
    return "a string field is not UTF-8" if "UTF-8" in text else "undecodable bytes"
