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

import time
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from dlite_ray.serve.affinity_router import prefix_key
from dlite_ray.serve.auth import KeyRing
from dlite_ray.serve.config import AppArgs
from dlite_ray.serve.conversation_turn import ConversationTurns
from dlite_ray.serve.errors import OutputFailed
from dlite_ray.serve.grpc_api import GrpcMethods
from dlite_ray.serve.metrics import Metrics
from dlite_ray.serve.openai_api import OpenAIRoutes, app
from dlite_ray.serve.request_types import ParsedRequest
from dlite_ray.serve.tenant_limits import TenantLimits
from dlite_ray.serve.turn_claims import holder_identity
from dlite_ray.serve.worker_probe import WorkerProbe


class DLiteIngress(OpenAIRoutes, GrpcMethods):
    def __init__(self, worker: DeploymentHandle, router: DeploymentHandle, args: AppArgs):
        self.worker, self.router, self.args = worker, router, args
        self.metrics = Metrics()
        self.keys = KeyRing.load(args.api_keys_file, args.api_keys_env, args.ops_tenants)
        self.tenant_limits = TenantLimits(args.limits.max_in_flight_per_tenant)
        self.probe = WorkerProbe(lambda: self.worker.stats.remote(), args.worker_probe_timeout_s,
                                 args.worker_probe_ttl_s, registry=self.metrics.registry)
        self.holder = holder_identity()  # who holds a conversation's turn: this replica
        self.turns = ConversationTurns(router, worker, self.holder, args.limits, self._generate)

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


DLiteIngressDeployment = serve.deployment(serve.ingress(app)(DLiteIngress), name="DLiteIngress")
