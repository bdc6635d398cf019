"""The dlite.v1.DLiteService side of DLiteIngress: one method per RPC (Serve's gRPC proxy
calls the deployment's method of the RPC's name). Streams that fail end with one error
chunk and the status set on the context; typed errors map to gRPC codes (errors.py)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

from dlite_ray.serve.errors import as_serve_error, error_message
from dlite_ray.serve.grpc_requests import parse_grpc_append, parse_grpc_create, parse_grpc_generate
from dlite_ray.serve.held_reply import held_for_tool_calls
from dlite_ray.serve.ingress_state import IngressState
from dlite_ray.serve.proto import dlite_pb2
from dlite_ray.serve.proto_convert import proto_chunk, proto_conversation
from dlite_ray.serve.request_limits import check_grpc_request, idempotency_key
from dlite_ray.serve.request_limits import conversation_id as valid_conversation_id
from dlite_ray.serve.store_probe import with_store
from dlite_ray.serve.worker_probe import health


class GrpcMethods(IngressState):
    """gRPC methods of DLiteIngress (a mixin: method names = RPC names)."""

    async def Generate(self, request: dlite_pb2.GenerateRequest, grpc_context=None):
        try:
            tenant = self._grpc_tenant(grpc_context)
            parsed = await asyncio.to_thread(parse_grpc_generate, request, self.args.limits)
            slot = self.tenant_limits.acquire(tenant)
        except Exception as exc:  # noqa: BLE001
            yield self._grpc_error(grpc_context, exc)
            return
        with slot:  # a cancelled RPC closes this generator, which releases the slot
            try:
                # a refused request: no chunk sent
                chunks, _ = await self._start(parsed.prompt, parsed.params, tenant=tenant)
                async for chunk in held_for_tool_calls(chunks, parsed.tools):
                    yield proto_chunk(chunk)
            except Exception as exc:  # noqa: BLE001
                yield self._grpc_error(grpc_context, exc)

    async def GetStats(self, request: dlite_pb2.GetStatsRequest, grpc_context=None):
        """Without a key, liveness only (as /healthz: degraded when the conversation store does
        not answer); with one that may read operational figures (ops_tenants), the worker's,
        the ingress's and the store's (`store_contract.StoreHealth`, null when the router did
        not answer) figures too."""
        try:
            check_grpc_request(request, self.args.limits)
            authorization = _metadata(grpc_context).get("authorization")
            full = authorization is not None or self.keys.is_local
            if full:
                self.keys.ops_tenant(authorization)
            stats = await self.probe.stats()
            store = await self.store_probe.health()
            body = with_store(health(stats), store)
            if full:
                body |= {"worker": asdict(stats) if stats is not None else None, "ingress": self.metrics.snapshot(),
                         "store": store}
            return dlite_pb2.ServerStats(json=json.dumps(body))
        except Exception as exc:  # noqa: BLE001
            return self._grpc_fail(grpc_context, exc, dlite_pb2.ServerStats())

    async def CreateConversation(self, request, grpc_context=None):
        try:
            tenant = self._grpc_tenant(grpc_context)
            messages = await asyncio.to_thread(parse_grpc_create, request, self.args.limits)
            return proto_conversation(await self.router.create.remote(tenant, messages))
        except Exception as exc:  # noqa: BLE001
            return self._grpc_fail(grpc_context, exc, dlite_pb2.Conversation())

    async def GetConversation(self, request, grpc_context=None):
        try:
            tenant = self._grpc_tenant(grpc_context)
            cid = _grpc_conversation_id(request, self.args.limits)
            return proto_conversation(await self.router.get.remote(tenant, cid))
        except Exception as exc:  # noqa: BLE001
            return self._grpc_fail(grpc_context, exc, dlite_pb2.Conversation())

    async def DeleteConversation(self, request, grpc_context=None):
        try:
            tenant = self._grpc_tenant(grpc_context)
            await self.router.delete.remote(tenant, _grpc_conversation_id(request, self.args.limits))
            return dlite_pb2.DeleteConversationResponse(deleted=True)
        except Exception as exc:  # noqa: BLE001
            return self._grpc_fail(grpc_context, exc, dlite_pb2.DeleteConversationResponse())

    async def AppendAndGenerate(self, request, grpc_context=None):
        try:
            tenant = self._grpc_tenant(grpc_context)
            turn = await asyncio.to_thread(parse_grpc_append, request, self.args.limits)
            valid_conversation_id(request.conversation_id)
            key = idempotency_key(_metadata(grpc_context).get("idempotency-key"))
            slot = self.tenant_limits.acquire(tenant)
        except Exception as exc:  # noqa: BLE001
            yield self._grpc_error(grpc_context, exc)
            return
        with slot:
            try:
                async for chunk in self.turns.run(tenant, request.conversation_id, turn, key):
                    yield proto_chunk(chunk)
            except Exception as exc:  # noqa: BLE001
                yield self._grpc_error(grpc_context, exc)

    def _grpc_tenant(self, context) -> str:
        return self.keys.tenant(_metadata(context).get("authorization"))

    def _grpc_fail(self, context, exc: Exception, empty):
        err = as_serve_error(exc)
        self.metrics.error(err)
        if context is not None:
            context.set_code(err.grpc_code)
            context.set_details(error_message(err))
        return empty

    def _grpc_error(self, context, exc: Exception) -> dlite_pb2.GenerateChunk:
        """The one chunk a failed stream yields (a stream that returns without yielding
        reaches the client as OK)."""
        return self._grpc_fail(context, exc, dlite_pb2.GenerateChunk(finish_reason="error"))


def _metadata(context) -> dict:
    return dict(context.invocation_metadata()) if context is not None else {}


def _grpc_conversation_id(request, limits) -> str:
    check_grpc_request(request, limits)
    return valid_conversation_id(request.conversation_id)
