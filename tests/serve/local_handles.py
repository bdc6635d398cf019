"""The serving stack in one process, without Ray: the real DLiteIngress, ConversationRouter
and TargetWorker, wired by in-process stand-ins for what Serve puts between them.

- `LocalHandle`: a DeploymentHandle over a plain object. Arguments and results cross
  `pickle` (what cannot cross a real handle fails here too); a call starts at `.remote()`,
  as Serve sends it then; a stream runs ahead of its reader on its own task, as a replica
  runs ahead of the caller; an exception reaches the caller wrapped as Ray wraps it
  (`RayTaskError(cause)`, an instance of the cause's class with `.cause`).
- `AsgiClient`: HTTP requests through the ingress's FastAPI app, as `serve.ingress` binds
  it, with the route's `self` (Serve's replica lookup) overridden to a given ingress.
- `GrpcContext`: the servicer context the ingress's gRPC methods read and set.
- `LocalApp`: the three deployments wired as `app.build_app` wires them.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import pickle
import traceback
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from ray.exceptions import RayTaskError


def crossed(value: Any) -> Any:
    """`value` as the other side of a handle sees it."""
    return pickle.loads(pickle.dumps(value))


def _remote_error(exc: Exception, method: str) -> Exception:
    """`exc` as a caller sees it through a handle: Ray's wrapper around a copy of it."""
    return RayTaskError(method, traceback.format_exc(), crossed(exc)).as_instanceof_cause()


class LocalHandle:
    """`handle.method.remote(...)` and `handle.options(stream=True).method.remote(...)` over
    `obj`. Options other than `stream` (Serve's routing, retries) are ignored; keyword
    arguments the router reads (`route_to=`) reach the method, which takes them."""

    def __init__(self, obj: Any, stream: bool = False):
        self._obj, self._stream = obj, stream

    def options(self, stream: bool | None = None, **_serve_options) -> LocalHandle:
        return LocalHandle(self._obj, self._stream if stream is None else stream)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(getattr(self._obj, name), name, self._stream)


class _Method:
    def __init__(self, fn: Callable, name: str, stream: bool):
        self._fn, self._name, self._stream = fn, name, stream

    def remote(self, *args, **kwargs) -> LocalResponse | LocalStream:
        args, kwargs = crossed((args, kwargs))
        if self._stream:
            return LocalStream(self._fn(*args, **kwargs), self._name)
        return LocalResponse(self._call(args, kwargs))

    async def _call(self, args: tuple, kwargs: dict) -> Any:
        try:
            out = self._fn(*args, **kwargs)
            if inspect.isawaitable(out):
                out = await out
        except Exception as exc:  # noqa: BLE001 - crosses the handle as Ray's wrapper
            raise _remote_error(exc, self._name) from None
        return crossed(out)


class LocalResponse:
    """A unary call, started at once on the running loop (or on `.result()` without one)."""

    def __init__(self, call):
        try:
            self._task = asyncio.get_running_loop().create_task(call)
            self._call = None
        except RuntimeError:  # a sync caller: runs in `result()`
            self._task, self._call = None, call

    def __await__(self):
        return self._task.__await__()

    def result(self, timeout_s: float | None = None) -> Any:
        assert self._call is not None, "result() is for callers without a running event loop; await instead"
        return asyncio.run(asyncio.wait_for(self._call, timeout_s))

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


_END = object()


class LocalStream:
    """A streamed call: the object's async generator runs on its own task from `.remote()`,
    its items queued (copied across) for the reader; `cancel()` stops it as Serve cancels
    the replica's request."""

    def __init__(self, gen: AsyncIterator, name: str):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._name, self._done = name, False
        self._task = asyncio.get_running_loop().create_task(self._pump(gen))

    async def _pump(self, gen: AsyncIterator) -> None:
        try:
            async for item in gen:
                self._queue.put_nowait(crossed(item))
        except Exception as exc:  # noqa: BLE001 - crosses the handle as Ray's wrapper
            self._queue.put_nowait(_remote_error(exc, self._name))
        finally:
            self._queue.put_nowait(_END)
            await gen.aclose()

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END or isinstance(item, Exception):
            self._done = True
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self._task.cancel()

    @property
    def running(self) -> bool:
        """Whether the object's generator still runs (not finished, failed or cancelled)."""
        return not self._task.done()


def target_worker(args, engine):
    """A TargetWorker serving `engine`: through `engine_factory=` where it takes one, else
    through the older `engine=`."""
    from dlite_ray.serve.target_worker import TargetWorker

    if "engine_factory" in inspect.signature(TargetWorker).parameters:
        return TargetWorker(args, engine_factory=lambda _engine_args: engine)
    return TargetWorker(args, engine=engine)


# -- HTTP ----------------------------------------------------------------------------------------
class AsgiResponse:
    """A response as it arrives: status and headers once the app starts it, the body piece by
    piece (`pieces`) or whole (`read`, `json`, `events`). `close()` is the client going away."""

    def __init__(self, status: int, headers: dict[str, str], messages: asyncio.Queue, task: asyncio.Task,
                 disconnect: asyncio.Event):
        self.status, self.headers = status, headers
        self._messages, self._task, self._disconnect = messages, task, disconnect
        self._ended = self._returned = False

    async def pieces(self) -> AsyncIterator[bytes]:
        while not self._ended:
            message = await self._messages.get()
            if message is None:  # the app returned or raised
                self._ended = self._returned = True
                break
            if message["type"] == "http.response.body":
                self._ended = not message.get("more_body", False)
                if message.get("body"):
                    yield message["body"]
        await self._task  # an exception the app let through fails the test here

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])

    async def json(self) -> Any:
        return json.loads(await self.read())

    async def events(self) -> list:
        """The SSE `data:` payloads: JSON objects, and "[DONE]"."""
        return sse_events(await self.read())

    async def close(self) -> None:
        """The client goes away; returns once the app has returned."""
        self._disconnect.set()
        while not self._returned:  # what the app still sends is dropped
            self._returned = await asyncio.wait_for(self._messages.get(), 30) is None
        await self._task


def sse_events(body: bytes) -> list:
    out = []
    for line in body.decode().split("\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def http_scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    """The ASGI scope of one HTTP request from a loopback client."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": headers, "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}


class AsgiClient:
    """HTTP to the ingress's FastAPI app in-process. `serve.ingress(app)` gives each route's
    `self` a dependency that asks Serve for the replica's object; while a request of this
    client runs, it answers with this client's ingress instead (a context variable, so
    clients of several ingresses may run at once)."""

    def __init__(self, ingress):
        from dlite_ray.serve.openai_api import app

        self.app, self.ingress = app, ingress
        _answer_self_with_current_ingress(app)

    async def request(self, method: str, path: str, json_body: Any = None, body: bytes | None = None,
                      headers: dict[str, str] | None = None) -> AsgiResponse:
        """Send a request; returns once the app has started its response."""
        if json_body is not None:
            body = json.dumps(json_body).encode()
        body = body or b""
        header_list = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
        header_list.append((b"content-length", str(len(body)).encode()))
        if json_body is not None:
            header_list.append((b"content-type", b"application/json"))
        scope = http_scope(method, path, header_list)
        # one message at a time: a stream the test does not read waits for it, as a server
        # writing to a client that does not read does (its slot stays held meanwhile)
        messages: asyncio.Queue = asyncio.Queue(maxsize=1)
        disconnect = asyncio.Event()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if disconnect.is_set() and message["type"] == "http.response.body":
                raise OSError("the client went away")  # as a server's send to a closed socket
            await messages.put(message)

        async def run() -> None:
            _CURRENT_INGRESS.set(self.ingress)  # this task's own context
            try:
                await self.app(scope, receive, send)
            finally:
                await messages.put(None)

        task = asyncio.get_running_loop().create_task(run())
        start = await messages.get()
        if start is None:
            await task
            raise AssertionError("the app returned without a response")
        assert start["type"] == "http.response.start", start
        response_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])}
        return AsgiResponse(start["status"], response_headers, messages, task, disconnect)

    async def post(self, path: str, json_body: Any = None, **kw) -> AsgiResponse:
        return await self.request("POST", path, json_body, **kw)

    async def get(self, path: str, **kw) -> AsgiResponse:
        return await self.request("GET", path, **kw)

    async def delete(self, path: str, **kw) -> AsgiResponse:
        return await self.request("DELETE", path, **kw)


_CURRENT_INGRESS: ContextVar = ContextVar("ingress", default=None)


def _answer_self_with_current_ingress(app) -> None:
    """Override the dependency `serve.ingress` gave the routes' `self` (one for the whole
    class, set as the default of `self` in each route method's signature): the current
    request's ingress, else Serve's replica lookup as before."""
    from dlite_ray.serve.openai_api import OpenAIRoutes

    serve_lookup = inspect.signature(OpenAIRoutes.chat_completions).parameters["self"].default.dependency

    async def current_ingress():
        ingress = _CURRENT_INGRESS.get()
        return ingress if ingress is not None else await serve_lookup()

    app.dependency_overrides.setdefault(serve_lookup, current_ingress)


# -- gRPC ----------------------------------------------------------------------------------------
class GrpcContext:
    """The servicer context the ingress's gRPC methods use: metadata in, status out."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()):
        self._metadata = metadata
        self.code, self.details = None, None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class LocalGrpc:
    """dlite.v1.DLiteService RPCs on an ingress object, requests and replies serialized as
    the wire carries them. Each call returns (reply or list of chunks, context)."""

    def __init__(self, ingress):
        self.ingress = ingress

    async def unary(self, method: str, request, metadata=()) -> tuple[Any, GrpcContext]:
        context = GrpcContext(metadata)
        reply = await getattr(self.ingress, method)(_wire(request), context)
        return _wire(reply), context

    async def stream(self, method: str, request, metadata=()) -> tuple[list, GrpcContext]:
        context = GrpcContext(metadata)
        chunks = [_wire(c) async for c in getattr(self.ingress, method)(_wire(request), context)]
        return chunks, context


def _wire(message):
    return type(message).FromString(message.SerializeToString())


# -- the application -----------------------------------------------------------------------------
class LocalApp:
    """DLiteIngress -> (TargetWorker, ConversationRouter -> TargetWorker), as `build_app`
    wires them, over LocalHandles. Build and use it inside one event loop; `close()` stops
    the worker's engine thread."""

    def __init__(self, args, engine, live_actors: Callable[[], set[str] | None] = lambda: None):
        from dlite_ray.serve.ingress import DLiteIngress
        from dlite_ray.serve.router import ConversationRouter

        self.args = args
        self.worker = target_worker(args, engine)
        self.router = ConversationRouter(LocalHandle(self.worker), args, live_actors=live_actors)
        self.ingress = DLiteIngress(LocalHandle(self.worker), LocalHandle(self.router), args)
        self.http = AsgiClient(self.ingress)
        self.grpc = LocalGrpc(self.ingress)

    def close(self) -> None:
        self.worker.async_engine.shutdown()


def tiny_engine(model_dirs, reply_cache_tokens: int = 0):
    """A DLiteEngine on `tiny_serving_model`'s (target dir, draft dir), its draft in-process,
    every round drafting or copying from the context (no adaptive length, no reply cache: a
    repeated request would otherwise copy its whole reply in one round), as the Ray tests'
    app configures it."""
    from dlite_ray.engine.engine import DLiteEngine

    target_dir, draft_dir = model_dirs
    return DLiteEngine.from_pretrained(target_dir, draft_dir, dtype="float32", adaptive_draft_length=False,
                                       max_kv_tokens=8192, reply_cache_tokens=reply_cache_tokens)


def local_args(tmp_path: Path, keys: dict[str, str], **overrides):
    """AppArgs for a LocalApp: `keys` (tenant -> key) in a keys file, the conversation store
    under `tmp_path`, no keys from the environment."""
    from dlite_ray.serve.config import AppArgs

    (tmp_path / "keys").write_text("".join(f"{key} {tenant}\n" for tenant, key in keys.items()))
    return AppArgs(api_keys_file=str(tmp_path / "keys"), api_keys_env=None,
                   conversations={"store_path": str(tmp_path / "conv.sqlite3")}, **overrides)
