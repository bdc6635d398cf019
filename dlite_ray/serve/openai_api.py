"""The OpenAI-compatible HTTP side of DLiteIngress: the FastAPI routes and the SSE body of a
streamed reply (the responses' shapes are `openai_responses.py`'s). Credentials and parsing
happen here, before anything reaches an engine; parsing runs off the event loop."""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import ExitStack
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from dlite_ray.serve.errors import PayloadTooLarge, as_serve_error, openai_error_body
from dlite_ray.serve.held_reply import held_for_tool_calls
from dlite_ray.serve.ingress_state import IngressState
from dlite_ray.serve.openai_requests import (
    decode_json_body,
    parse_append,
    parse_chat,
    parse_completion,
    parse_create_conversation,
)
from dlite_ray.serve.openai_responses import (
    Reply,
    completion,
    conversation_reply,
    sse_event,
    stream_choice,
    stream_chunk,
    usage,
)
from dlite_ray.serve.request_limits import conversation_id as valid_conversation_id
from dlite_ray.serve.request_limits import idempotency_key
from dlite_ray.serve.request_types import ParsedRequest
from dlite_ray.serve.store_probe import with_store
from dlite_ray.serve.worker_messages import GenerateChunk
from dlite_ray.serve.worker_probe import health

# no /docs, /redoc or /openapi.json: the API is documented in the repository, not served unauthenticated
app = FastAPI(title="dlite-ray", description="DLite speculative decoding, OpenAI-compatible",
              docs_url=None, redoc_url=None, openapi_url=None)


class OpenAIRoutes(IngressState):
    """HTTP endpoints of DLiteIngress (a mixin: Serve needs the routes on the deployment class)."""

    @app.get("/healthz")
    async def healthz(self) -> JSONResponse:
        """Open to all, so it says only whether a TargetWorker answers (503 when none does) and,
        when it serves without its draft, which replica and why (`worker_probe.health`); when
        the conversation store does not answer, that (degraded: completions still serve)."""
        body = with_store(health(await self.probe.stats()), await self.store_probe.health())
        return JSONResponse(body, status_code=503 if body["status"] == "unavailable" else 200)

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.args.model_name, "object": "model", "owned_by": "dlite-ray"}]}

    @app.get("/metrics")
    async def prometheus(self, request: Request):
        """Prometheus text; the worker figures are left as last seen when no worker answers
        in time (dlite_worker_up 0), the store's latency as last seen when it does not answer
        (dlite_store_up 0)."""
        try:
            self.keys.ops_tenant(request.headers.get("authorization"))
        except Exception as exc:  # noqa: BLE001
            return self._error_response(exc)
        stats = await self.probe.stats()
        if stats is not None:
            self.metrics.set_worker_stats(stats)
        await self.store_probe.health()  # dlite_store_up, dlite_store_latency_seconds
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._http(request, parse_chat, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._http(request, parse_completion, chat=False)

    async def _http(self, request: Request, parse, chat: bool):
        # What the request holds (its tenant slot, its worker stream) is released in one
        # place, however the request ends: an error, the reply's end, or a cancellation
        # (a client gone or Serve's request timeout before the first token raises
        # CancelledError, which no `except Exception` sees). A streamed reply takes it over.
        with ExitStack() as held:
            try:
                tenant = self.keys.tenant(request.headers.get("authorization"))
                parsed = await self._parse(request, parse)
                held.callback(self.tenant_limits.acquire(tenant).release)
                # the replica that runs it validates it: a refused request is a 4xx, not a 200 stream that fails
                chunks, cancel = await self._start(parsed.prompt, parsed.params, tenant=tenant)
                held.callback(cancel)  # a no-op once the reply finished
            except Exception as exc:  # noqa: BLE001 - every failure becomes a typed error response
                return self._error_response(exc)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            if parsed.stream:
                return self._streaming_response(rid, parsed, chat, held.pop_all(), chunks)
            text, finish, stats, n, logprobs = "", None, None, 0, []
            try:
                async for chunk in chunks:
                    text += chunk.text
                    n += len(chunk.token_ids)
                    finish, stats = chunk.finish_reason or finish, chunk.stats or stats
                    logprobs += chunk.logprobs or []
            except Exception as exc:  # noqa: BLE001 - a replica lost or a step failed: a typed error, not a bare 500
                return self._error_response(exc)
        return completion(rid, self.args.model_name, parsed, chat, Reply(text, finish, stats, n, logprobs))

    def _streaming_response(self, rid: str, parsed: ParsedRequest, chat: bool, held: ExitStack,
                            chunks: AsyncGenerator[GenerateChunk, None]) -> StreamingResponse:
        body = self._sse(rid, parsed, chat, held, chunks)
        # A client gone before the server starts the stream leaves the generator unstarted, so
        # its finally never runs; releasing when the generator is collected covers that case
        # (ExitStack.close is idempotent: what it released once it does not release again).
        weakref.finalize(body, held.close)
        return StreamingResponse(body, media_type="text/event-stream")

    async def _sse(self, rid: str, parsed: ParsedRequest, chat: bool, held: ExitStack,
                   chunks: AsyncGenerator[GenerateChunk, None]) -> AsyncIterator[str]:
        """The SSE body of a reply already accepted (`chunks`); it owns what the request
        holds (`held`: the tenant slot, the worker stream), released however the stream
        ends (a client disconnect cancels or closes this generator, which runs the finally)."""
        text_offset = 0  # a completion stream's logprob offsets run on from chunk to chunk
        n, stats = 0, None
        first = chat  # a chat stream's first delta names the role, as OpenAI's do
        try:
            async for chunk in held_for_tool_calls(chunks, parsed.tools):
                n, stats = n + len(chunk.token_ids), chunk.stats or stats
                if not (chunk.text or chunk.logprobs or chunk.finished):
                    continue  # held back: nothing to send yet
                choice, text_offset = stream_choice(chunk, parsed, chat, first, text_offset)
                first = False
                # with include_usage, OpenAI's other chunks carry "usage": null
                yield sse_event(stream_chunk(rid, self.args.model_name, chat, [choice],
                                             **({"usage": None} if parsed.include_usage else {})))
            if parsed.include_usage:  # OpenAI's last chunk: no choices, the request's token counts
                yield sse_event(stream_chunk(rid, self.args.model_name, chat, [], usage=usage(stats, n)))
        except Exception as exc:  # noqa: BLE001 - the stream ends with an error event, others unaffected
            err = as_serve_error(exc)
            yield sse_event(openai_error_body(err))
        finally:
            held.close()
            await chunks.aclose()
        yield "data: [DONE]\n\n"

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
        err = as_serve_error(exc)
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
                async for chunk in self.turns.run(tenant, conversation_id, turn, key):
                    text += chunk.text
                    finish, replica = chunk.finish_reason or finish, chunk.replica or replica
                    stats, calls = chunk.stats or stats, chunk.tool_calls or calls
                    logprobs += chunk.logprobs or []
            return conversation_reply(conversation_id, turn, Reply(text, finish, stats, 0, logprobs), calls, replica)
        return await self._http_call(go)


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
