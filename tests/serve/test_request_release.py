"""What an HTTP request holds at the ingress (its tenant slot, its worker stream) is
released however the request ends: here, cancelled before its first token, as a client
that leaves or Serve's request_timeout_s cancels it (issue 53 item 1). Without Ray: the
real DLiteIngress over a worker whose first chunk waits on an event the test holds."""

from __future__ import annotations

import asyncio
import json

from dlite_ray.serve.worker_messages import GenerateChunk
from tests.serve import local_handles
from tests.serve.local_handles import AsgiClient, LocalHandle, http_scope, local_args

KEYS = {"tenant-a": "key-a"}
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class StalledWorker:
    """A TargetWorker whose replies send nothing until `go` is set."""

    def __init__(self):
        self.started, self.go = asyncio.Event(), asyncio.Event()
        self.requests = 0

    async def generate(self, prompt, params, **_routing):
        self.requests += 1
        self.started.set()
        await self.go.wait()
        yield GenerateChunk([1], "x", finished=True, finish_reason="stop", replica="stalled")


def _ingress(tmp_path, worker: StalledWorker):
    from dlite_ray.serve.ingress import DLiteIngress

    return DLiteIngress(LocalHandle(worker), LocalHandle(object()), local_args(tmp_path, KEYS))


def _send(client: AsgiClient, body: dict) -> asyncio.Task:
    """A POST to /v1/chat/completions on its own task (what Serve cancels when the client
    leaves); what the app sends is dropped."""
    raw = json.dumps(body).encode()
    scope = http_scope("POST", "/v1/chat/completions", [
        (b"authorization", b"Bearer key-a"), (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode())])
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client never says it left: Serve cancels the task instead

    async def send(_message: dict) -> None:
        return None

    async def run() -> None:
        local_handles._CURRENT_INGRESS.set(client.ingress)
        await client.app(scope, receive, send)

    return asyncio.get_running_loop().create_task(run())


def _cancel_before_the_first_token(tmp_path, body: dict) -> tuple[int, int]:
    async def main():
        worker = StalledWorker()
        ingress = _ingress(tmp_path, worker)
        client = AsgiClient(ingress)
        for _ in range(ingress.tenant_limits.max_in_flight + 1):  # past the cap, were slots kept
            worker.started.clear()
            task = _send(client, body)
            started = asyncio.ensure_future(worker.started.wait())
            # the request waits on its first token now, or was refused (429) without reaching the worker
            await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return ingress.tenant_limits.in_flight("tenant-a"), worker.requests

    return asyncio.run(main())


def test_a_request_cancelled_before_its_first_token_releases_its_slot(tmp_path):
    in_flight, requests = _cancel_before_the_first_token(tmp_path, BODY)
    assert requests == 9  # every one reached the worker: none was refused with 429
    assert in_flight == 0


def test_a_stream_cancelled_before_its_first_token_releases_its_slot(tmp_path):
    in_flight, requests = _cancel_before_the_first_token(tmp_path, {**BODY, "stream": True})
    assert requests == 9 and in_flight == 0
