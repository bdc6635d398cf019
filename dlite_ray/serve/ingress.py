"""DLiteIngress: OpenAI-compatible HTTP (FastAPI, openai_api) and the dlite.v1.DLiteService
gRPC methods (grpc_api), in one deployment in front of the TargetWorker replicas and the
ConversationRouter; conversation turns run in conversation_turn. Credentials and
validation happen here, before anything reaches an engine; typed errors map once to
status codes (errors.py).

The ingress must never be where one client waits on another: its concurrency is sized to
its tenants' limits (app.ingress_options), a tenant over its limit is refused at once,
sizes are checked before any tokenizing, and parsing runs off the event loop. /healthz and
/metrics ask the workers with a deadline (worker_probe); operational figures need a key."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import cast

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from dlite_ray.engine.engine import Prompt
from dlite_ray.engine.sequence import SamplingParams
from dlite_ray.serve.affinity_router import prefix_key
from dlite_ray.serve.auth import KeyRing
from dlite_ray.serve.config import AppArgs
from dlite_ray.serve.conversation_turn import ConversationTurns
from dlite_ray.serve.errors import OutputFailed
from dlite_ray.serve.grpc_api import GrpcMethods
from dlite_ray.serve.metrics import Metrics
from dlite_ray.serve.openai_api import OpenAIRoutes, app
from dlite_ray.serve.store_probe import StoreProbe
from dlite_ray.serve.tenant_limits import TenantLimits
from dlite_ray.serve.turn_claims import holder_identity
from dlite_ray.serve.worker_messages import GenerateChunk
from dlite_ray.serve.worker_probe import WorkerProbe

log = logging.getLogger(__name__)


class DLiteIngress(OpenAIRoutes, GrpcMethods):
    def __init__(self, worker: DeploymentHandle, router: DeploymentHandle, args: AppArgs):
        self.worker, self.router, self.args = worker, router, args
        self.metrics = Metrics()
        self.keys = KeyRing.load(args.api_keys_file, args.api_keys_env, args.ops_tenants)
        self.tenant_limits = TenantLimits(args.limits.max_in_flight_per_tenant)
        self.probe = WorkerProbe(lambda: self.worker.stats.remote(), args.worker_probe_timeout_s,
                                 args.worker_probe_ttl_s, registry=self.metrics.registry)
        self.store_probe = StoreProbe(lambda: self.router.store_health.remote(), args.worker_probe_timeout_s,
                                      args.worker_probe_ttl_s, registry=self.metrics.registry)
        self.holder = holder_identity()  # who holds a conversation's turn: this replica
        self.turns = ConversationTurns(router, self.holder, self._start)

    async def _start(self, prompt: Prompt, params: SamplingParams, route_to: str | None = None,
                     conversation: str | None = None,
                     tenant: str | None = None) -> tuple[AsyncGenerator[GenerateChunk, None], Callable[[], None]]:
        """Send one request to a TargetWorker and wait for its first chunk: the replica that
        runs it tokenizes and validates it, and a request it refuses (InvalidRequest: over
        the context, a grammar it cannot use) raises here, before a caller commits to a
        response (a 200 stream that would only then fail). Returns the reply's chunks (the
        first included) and `cancel`, for a caller that drops them unread. `tenant` names
        whose earlier replies the reply may copy from (the worker's reply cache).

        Why wait for the first token rather than an "accepted" chunk sent before prefill:
        the engine validates a request in two places (the prompt's tokens on the caller's
        side, the KV budget and grammar on its step thread), so only its first output says
        that it was accepted; a stream's client sees nothing sooner either way."""
        started = time.perf_counter()
        stream = _WorkerStream(cast(DeploymentResponseGenerator, self.worker.options(stream=True).generate.remote(
            prompt, params, route_to=route_to, conversation=conversation, prefix_key=prefix_key(prompt),
            tenant=tenant)))  # stream=True: a generator
        try:
            first = await anext(stream.chunks, None)
        except BaseException:
            stream.close()
            raise
        if first is None:
            raise RuntimeError("the TargetWorker's stream ended without a chunk")
        return self._chunks(first, stream, started), stream.close

    async def _chunks(self, first: GenerateChunk, stream: _WorkerStream,
                      started: float) -> AsyncGenerator[GenerateChunk, None]:
        try:
            chunk: GenerateChunk | None = first
            while chunk is not None:
                if chunk.finished:
                    stream.finished = True
                    self.metrics.finished(chunk.stats, time.perf_counter() - started)
                    await self._report_evicted(chunk)
                    if chunk.error:  # finish_reason "error": the output grammar failed mid-reply
                        raise OutputFailed(chunk.error, chunk.replica)
                yield chunk
                chunk = await anext(stream.chunks, None)
        finally:
            stream.close()  # the caller went away mid-reply: stop generating it

    async def _report_evicted(self, last: GenerateChunk) -> None:
        """The one place a worker's eviction report reaches the registry: every reply's last
        chunk (a plain completion's as much as a conversation turn's) names the conversations
        whose KV its replica gave up while it ran, and the worker hands each name out once."""
        if not last.evicted or last.replica is None:
            return
        try:
            await self.router.mark_evicted.remote(last.evicted, last.replica)
        except Exception as exc:  # noqa: BLE001 - the reply stands; the registry finds out at the next miss
            log.warning("could not report conversations evicted on %s: %s", last.replica, exc)


class _WorkerStream:
    """A request's stream from a TargetWorker; `close` cancels it unless it finished."""

    def __init__(self, chunks: DeploymentResponseGenerator):
        self.chunks, self.finished = chunks, False

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.chunks.cancel()


DLiteIngressDeployment = serve.deployment(name="DLiteIngress")(serve.ingress(app)(DLiteIngress))
