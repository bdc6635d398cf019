"""What DLiteIngress's two mixins (openai_api's routes, grpc_api's methods) read of it,
declared once for the type checker; DLiteIngress.__init__ sets each (ingress.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from dlite_ray.serve.auth import KeyRing
    from dlite_ray.serve.config import AppArgs
    from dlite_ray.serve.conversation_turn import ConversationTurns
    from dlite_ray.serve.metrics import Metrics
    from dlite_ray.serve.store_probe import StoreProbe
    from dlite_ray.serve.tenant_limits import TenantLimits
    from dlite_ray.serve.worker_messages import GenerateChunk
    from dlite_ray.serve.worker_probe import WorkerProbe

# (prompt, params, route_to=, conversation=, tenant=) -> (the reply's chunks, cancel): DLiteIngress._start
StartRequest = Callable[..., Awaitable[tuple[AsyncGenerator["GenerateChunk", None], Callable[[], None]]]]


class IngressState:
    """Annotations only: no attribute is set here."""

    args: AppArgs
    router: DeploymentHandle
    metrics: Metrics
    keys: KeyRing
    tenant_limits: TenantLimits
    probe: WorkerProbe
    store_probe: StoreProbe
    turns: ConversationTurns
    _start: StartRequest
