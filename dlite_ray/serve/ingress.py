"""DLiteIngress: OpenAI-compatible HTTP (FastAPI) and the dlite.v1.DLiteService gRPC
methods, in one deployment in front of the TargetWorker replicas and the
ConversationRouter. Credentials and validation happen here, before anything reaches an
engine; typed errors map once to status codes.

The ingress must never be where one client waits on another: its concurrency is sized to
its tenants' limits (app.ingress_options), a tenant over its limit is refused at once,
sizes are checked before any tokenizing, and parsing runs off the event loop. /healthz and
/metrics ask the workers with a deadline (worker_probe); operational figures need a key."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from dlite_ray.engine.request_stats import RequestStats
from dlite_ray.serve.affinity_router import prefix_key
from dlite_ray.serve.auth import KeyRing
from dlite_ray.serve.config import AppArgs
from dlite_ray.serve.errors import OutputFailed, PayloadTooLarge, as_serve_error, error_message, openai_error_body
from dlite_ray.serve.held_reply import held_for_tool_calls
from dlite_ray.serve.logprobs import completion_logprobs
from dlite_ray.serve.metrics import Metrics
from dlite_ray.serve.proto import dlite_pb2
from dlite_ray.serve.proto_convert import proto_chunk, proto_conversation
from dlite_ray.serve.request_limits import check_grpc_request, check_prompt_chars, idempotency_key
from dlite_ray.serve.request_limits import conversation_id as valid_conversation_id
from dlite_ray.serve.requests import (
    ConversationTurn,
    ParsedRequest,
    decode_json_body,
    parse_append,
    parse_chat,
    parse_completion,
    parse_create_conversation,
    parse_grpc_append,
    parse_grpc_create,
    parse_grpc_generate,
    tools_in,
)
from dlite_ray.serve.tenant_limits import TenantLimits, TenantSlot
from dlite_ray.serve.tool_calls import assistant_message, chat_message, tool_calls_delta
from dlite_ray.serve.turn_claims import RENEWED_CLAIM_S, holder_identity, renewed, replay_chunk
from dlite_ray.serve.worker_probe import WorkerProbe

log = logging.getLogger(__name__)
# no /docs, /redoc or /openapi.json: the API is documented in the repository, not served unauthenticated
app = FastAPI(title="dlite-ray", description="DLite speculative decoding, OpenAI-compatible",
              docs_url=None, redoc_url=None, openapi_url=None)


class DLiteIngress:
    def __init__(self, worker: DeploymentHandle, router: DeploymentHandle, args: AppArgs):
        self.worker, self.router, self.args = worker, router, args
        self.metrics = Metrics()
        self.keys = KeyRing.load(args.api_keys_file, args.api_keys_env, args.ops_tenants)
        self.tenant_limits = TenantLimits(args.limits.max_in_flight_per_tenant)
        self.probe = WorkerProbe(lambda: self.worker.stats.remote(), args.worker_probe_timeout_s,
                                 args.worker_probe_ttl_s, registry=self.metrics.registry)
        self.holder = holder_identity()  # who holds a conversation's turn: this replica

    # -- HTTP -------------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz(self) -> JSONResponse:
        """Open to all, so it says only whether a TargetWorker answers (503 when none does)."""
        if await self.probe.stats() is None:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.args.model_name, "object": "model", "owned_by": "dlite-ray"}]}

    @app.get("/metrics")
    async def prometheus(self, request: Request):
        """Prometheus text; the worker figures are left as last seen when no worker answers
        in time (dlite_worker_up 0)."""
        try:
            self.keys.ops_tenant(request.headers.get("authorization"))
        except Exception as exc:  # noqa: BLE001
            return self._error_response(exc)
        stats = await self.probe.stats()
        if stats is not None:
            self.metrics.set_worker_stats(stats)
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._http(request, parse_chat, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._http(request, parse_completion, chat=False)

    async def _http(self, request: Request, parse, chat: bool):
        slot: TenantSlot | None = None
        try:
            tenant = self.keys.tenant(request.headers.get("authorization"))
            parsed = await self._parse(request, parse)
            slot = self.tenant_limits.acquire(tenant)
            await self.worker.encode.remote(parsed.prompt)  # context-length errors before streaming starts
        except Exception as exc:  # noqa: BLE001 - every failure becomes a typed error response
            if slot is not None:
                slot.release()
            return self._error_response(exc)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if parsed.stream:
            body = self._sse(rid, parsed, chat, slot)
            # A client gone before the server starts the stream leaves the generator unstarted, so
            # its finally never runs; releasing when the generator is collected covers that case.
            weakref.finalize(body, slot.release)
            return StreamingResponse(body, media_type="text/event-stream")
        text, finish, stats, n, logprobs = "", None, None, 0, []
        with slot:
            try:
                async for chunk in self._generate(parsed):
                    text += chunk["text"]
                    n += len(chunk["token_ids"])
                    finish, stats = chunk["finish_reason"] or finish, chunk["stats"] or stats
                    logprobs += chunk["logprobs"] or []
            except Exception as exc:  # noqa: BLE001 - a replica lost or a step failed: a typed error, not a bare 500
                return self._error_response(exc)
        usage = _usage(stats, n)
        if chat:
            message, finish = chat_message(text, finish, parsed.tools)
            choice = {"index": 0, "message": message, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
        choice["logprobs"], _ = _choice_logprobs(parsed, chat, logprobs)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.args.model_name, "choices": [choice], "usage": usage, "dlite_stats": _public_stats(stats)}

    async def _sse(self, rid: str, parsed: ParsedRequest, chat: bool, slot: TenantSlot) -> AsyncIterator[str]:
        """The SSE body; it owns the tenant slot, released however the stream ends (a client
        disconnect cancels or closes this generator, which runs the finally)."""
        text_offset = 0  # a completion stream's logprob offsets run on from chunk to chunk
        n, stats = 0, None
        first = chat  # a chat stream's first delta names the role, as OpenAI's do
        try:
            async for chunk in held_for_tool_calls(self._generate(parsed), parsed.tools):
                n, stats = n + len(chunk["token_ids"]), chunk["stats"] or stats
                if not (chunk["text"] or chunk["logprobs"] or chunk["finished"]):
                    continue  # held back: nothing to send yet
                choice = _stream_choice(chunk, chat)
                if first:
                    choice["delta"], first = {"role": "assistant", **choice["delta"]}, False
                choice["logprobs"], text_offset = _choice_logprobs(parsed, chat, chunk["logprobs"], text_offset)
                # with include_usage, OpenAI's other chunks carry "usage": null
                yield self._sse_chunk(rid, chat, [choice], **({"usage": None} if parsed.include_usage else {}))
            if parsed.include_usage:  # OpenAI's last chunk: no choices, the request's token counts
                yield self._sse_chunk(rid, chat, [], usage=_usage(stats, n))
        except Exception as exc:  # noqa: BLE001 - the stream ends with an error event, others unaffected
            err = as_serve_error(_unwrap(exc))
            yield f"data: {json.dumps(openai_error_body(err))}\n\n"
        finally:
            slot.release()
        yield "data: [DONE]\n\n"

    def _sse_chunk(self, rid: str, chat: bool, choices: list[dict], **extra) -> str:
        body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.args.model_name, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    async def _parse(self, request: Request, parse) -> Any:
        """The body through `decode_json_body` and `parse`, in a thread: a large body or schema
        must not hold up the streams this event loop serves."""
        raw = await _read_body(request, self.args.limits.max_body_bytes)
        return await asyncio.to_thread(lambda: parse(decode_json_body(raw, self.args.limits), self.args.limits))

    async def _http_call(self, coro_fn):
        """Run a JSON endpoint; typed errors become OpenAI error bodies."""
        try:
            return await coro_fn()
        except Exception as exc:  # noqa: BLE001
            return self._error_response(exc)

    def _error_response(self, exc: Exception) -> JSONResponse:
        err = as_serve_error(_unwrap(exc))
        self.metrics.error(err)
        return JSONResponse(openai_error_body(err), status_code=err.http_status)

    @app.post("/v1/conversations")
    async def http_create_conversation(self, request: Request):
        async def go():
            tenant = self.keys.tenant(request.headers.get("authorization"))
            messages = await self._parse(request, parse_create_conversation)
            return await self.router.create.remote(tenant, messages)
        return await self._http_call(go)

    @app.get("/v1/conversations/{conversation_id}")
    async def http_get_conversation(self, conversation_id: str, request: Request):
        async def go():
            tenant = self.keys.tenant(request.headers.get("authorization"))
            return await self.router.get.remote(tenant, valid_conversation_id(conversation_id))
        return await self._http_call(go)

    @app.delete("/v1/conversations/{conversation_id}")
    async def http_delete_conversation(self, conversation_id: str, request: Request):
        async def go():
            tenant = self.keys.tenant(request.headers.get("authorization"))
            return {"deleted": await self.router.delete.remote(tenant, valid_conversation_id(conversation_id))}
        return await self._http_call(go)

    @app.post("/v1/conversations/{conversation_id}/messages")
    async def http_append_and_generate(self, conversation_id: str, request: Request):
        async def go():
            tenant = self.keys.tenant(request.headers.get("authorization"))
            valid_conversation_id(conversation_id)
            turn = await self._parse(request, parse_append)
            text, finish, replica, stats, logprobs, calls = "", None, None, None, [], None
            key = idempotency_key(request.headers.get("idempotency-key"))
            with self.tenant_limits.acquire(tenant):
                async for chunk in self._conversation_turn(tenant, conversation_id, turn, key):
                    text += chunk["text"]
                    finish, replica = chunk["finish_reason"] or finish, chunk.get("replica") or replica
                    stats, calls = chunk["stats"] or stats, chunk["tool_calls"] or calls
                    logprobs += chunk["logprobs"] or []
            return {"conversation_id": conversation_id, "message": assistant_message(text, calls),
                    "logprobs": None if turn.params.logprobs is None else {"content": logprobs},
                    "finish_reason": finish, "replica": replica, "stats": _public_stats(stats)}
        return await self._http_call(go)

    async def _conversation_turn(self, tenant: str, conversation_id: str, turn: ConversationTurn,
                                 idempotency_key: str | None = None) -> AsyncIterator[dict]:
        """Claim the conversation, generate from its whole history, store the reply, pause.
        The history's KV and boundary features stay cached on the replica that made them;
        a miss re-prefills from the durable history (slower, never wrong). The claim names
        this replica and is renewed while the reply streams, so a turn whose ingress dies
        frees the conversation (turn_claims.py); a retry with the same idempotency key
        replays the stored reply instead of appending the turn twice."""
        # A history that could never be served (over the context) is refused before anything
        # is appended, so a client's retry does not pile up copies of the same messages.
        current = await self.router.get.remote(tenant, conversation_id)
        pending = turn.new_messages
        if idempotency_key and current["messages"][-len(pending):] == pending:
            pending = []  # a retry: its messages are in the history already
        check_prompt_chars(current["messages"] + pending, self.args.limits,
                           "the conversation's history and this turn's messages")
        await self.worker.encode.remote(current["messages"] + pending)
        conv = await self.router.begin_turn.remote(tenant, conversation_id, turn.new_messages, holder=self.holder,
                                                   idempotency_key=idempotency_key, claim_s=RENEWED_CLAIM_S)
        if conv.get("replayed") is not None:  # finished before: the stored reply, nothing generated
            async for chunk in held_for_tool_calls(_one(replay_chunk(conv["replayed"])), tools_in(conv["messages"])):
                yield chunk
            return
        version = conv["version"]
        text, replica, evicted, done, finish, failed_on = "", None, [], False, None, None
        # to the replica that holds this conversation's KV (the affinity router falls back
        # to load when it is gone); the reply's KV stays pinned there (the lease)
        chunks = renewed(self._generate(ParsedRequest(conv["messages"], turn.params), route_to=conv["replica"],
                                        conversation=conversation_id),
                         lambda: self.router.renew_turn.remote(tenant, conversation_id, version, RENEWED_CLAIM_S))
        try:
            async for chunk in held_for_tool_calls(chunks, tools_in(conv["messages"])):
                text += chunk["raw_text"]  # the history keeps calls as the model wrote them
                replica = chunk.get("replica") or replica
                evicted = chunk.get("evicted") or evicted
                finish = chunk["finish_reason"] or finish
                done = done or chunk["finished"]
                yield chunk
        except OutputFailed as exc:
            failed_on = exc.replica  # the engine finished that reply: its KV stays pinned there
            raise
        finally:
            await chunks.aclose()  # no renewal may land after the turn ends (it would claim it again)
            if failed_on is not None:
                await self.worker.release_lease.remote(conversation_id, route_to=failed_on, strict=False)
            if done:
                await self.router.finish_turn.remote(tenant, conversation_id, version, text, replica, turn.lease_s,
                                                     finish_reason=finish)
                evicted = [c for c in evicted if c != conversation_id]  # this reply pinned it again
                if evicted:
                    await self.router.mark_evicted.remote(evicted, replica)
            else:
                await self.router.abandon_turn.remote(tenant, conversation_id, version=version)

    async def _generate(self, parsed: ParsedRequest, route_to: str | None = None,
                        conversation: str | None = None) -> AsyncIterator[dict]:
        params = {f: getattr(parsed.params, f)
                  for f in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "logprobs", "grammar")}
        started = time.perf_counter()
        stream = self.worker.options(stream=True).generate.remote(
            parsed.prompt, params, route_to=route_to, conversation=conversation, prefix_key=prefix_key(parsed.prompt))
        async for chunk in stream:
            if chunk["finished"]:
                self.metrics.finished(chunk["stats"], time.perf_counter() - started)
                if chunk.get("error"):  # finish_reason "error": the output grammar failed mid-reply
                    raise OutputFailed(chunk["error"], chunk.get("replica"))
            yield chunk

    # -- gRPC (method names = RPC names) --------------------------------------------------------
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
                await self.worker.encode.remote(parsed.prompt)
                async for chunk in held_for_tool_calls(self._generate(parsed), parsed.tools):
                    yield proto_chunk(chunk)
            except Exception as exc:  # noqa: BLE001
                yield self._grpc_error(grpc_context, exc)

    async def GetStats(self, request: dlite_pb2.GetStatsRequest, grpc_context=None):
        """Without a key, liveness only (as /healthz); with one that may read operational
        figures (ops_tenants), the worker's and the ingress's figures too."""
        try:
            check_grpc_request(request, self.args.limits)
            authorization = _metadata(grpc_context).get("authorization")
            full = authorization is not None or self.keys.is_local
            if full:
                self.keys.ops_tenant(authorization)
            stats = await self.probe.stats()
            body = {"status": "ok" if stats is not None else "unavailable"}
            if full:
                body |= {"worker": stats, "ingress": self.metrics.snapshot()}
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
                async for chunk in self._conversation_turn(tenant, request.conversation_id, turn, key):
                    yield proto_chunk(chunk)
            except Exception as exc:  # noqa: BLE001
                yield self._grpc_error(grpc_context, exc)

    def _grpc_tenant(self, context) -> str:
        return self.keys.tenant(_metadata(context).get("authorization"))

    def _grpc_fail(self, context, exc: Exception, empty):
        err = as_serve_error(_unwrap(exc))
        self.metrics.error(err)
        if context is not None:
            context.set_code(err.grpc_code)
            context.set_details(error_message(err))
        return empty

    def _grpc_error(self, context, exc: Exception) -> dlite_pb2.GenerateChunk:
        """The one chunk a failed stream yields (a stream that returns without yielding
        reaches the client as OK)."""
        return self._grpc_fail(context, exc, dlite_pb2.GenerateChunk(finish_reason="error"))


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused (413) as soon as it passes `max_bytes`, before it is all in memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds this server's max_body_bytes of {max_bytes}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise PayloadTooLarge(f"body of more than {max_bytes} bytes exceeds this server's max_body_bytes")
    return bytes(body)


async def _one(chunk: dict) -> AsyncIterator[dict]:
    yield chunk


def _metadata(context) -> dict:
    return dict(context.invocation_metadata()) if context is not None else {}


def _grpc_conversation_id(request, limits) -> str:
    check_grpc_request(request, limits)
    return valid_conversation_id(request.conversation_id)


def _unwrap(exc: Exception) -> Exception:
    """Ray wraps replica exceptions; find the typed cause for the status mapping."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc


def _stream_choice(chunk: dict, chat: bool) -> dict:
    if chunk["tool_calls"]:
        return {"index": 0, "delta": tool_calls_delta(chunk["tool_calls"]), "finish_reason": chunk["finish_reason"]}
    if chat:
        return {"index": 0, "delta": {"content": chunk["text"]}, "finish_reason": chunk["finish_reason"]}
    return {"index": 0, "text": chunk["text"], "finish_reason": chunk["finish_reason"]}


def _usage(stats: RequestStats | None, completion_tokens: int) -> dict:
    prompt_tokens = stats.num_prompt_tokens if stats is not None else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice_logprobs(parsed: ParsedRequest, chat: bool, entries: list[dict],
                     text_offset: int = 0) -> tuple[dict | None, int]:
    """A choice's `logprobs` (None unless the request asked for them), and the completion
    text offset after them."""
    if parsed.params.logprobs is None:
        return None, text_offset
    return ({"content": entries}, text_offset) if chat else completion_logprobs(entries, text_offset)


def _public_stats(stats: RequestStats | None) -> dict:
    if stats is None:
        return {}
    keys = ("mean_accept_length", "accept_lengths", "prefill_time", "decode_wall_time", "draft_time", "verify_time",
            "decode_tokens_per_second", "ttft", "cached_prompt_tokens")
    return {k: getattr(stats, k) for k in keys}


DLiteIngressDeployment = serve.deployment(serve.ingress(app)(DLiteIngress), name="DLiteIngress")
