"""The Serve application builder: `serve run deployments/dlite.yaml`."""

from __future__ import annotations

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from dlite_ray.serve.auth import KeyRing
from dlite_ray.serve.config import AppArgs, EngineArgs
from dlite_ray.serve.ingress import DLiteIngressDeployment
from dlite_ray.serve.router import ConversationRouterDeployment
from dlite_ray.serve.target_worker import TargetWorkerDeployment

ROUTER_MAX_ONGOING = 1000
ROUTER_CLASS = "dlite_ray.serve.affinity_router:ConversationAffinityRouter"


def build_app(args: AppArgs | dict) -> Application:
    """Ingress in front of TargetWorker pairs (target bundle + draft bundle each)."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    disaggregated = args.engine.disaggregated_draft and args.engine.draft != "none"
    gpu = args.engine.device == "cuda"
    # A bundle may not be all zeros: a token CPU share keeps 2-core machines schedulable.
    cpus = max(args.replica_num_cpus, 0.01)
    gpus = pair_gpu_share(args.engine) if gpu else 0
    bundle = {"CPU": cpus, "GPU": gpus} if gpu else {"CPU": cpus}
    if gpu and args.accelerator_type:
        bundle[f"accelerator_type:{args.accelerator_type}"] = 0.001
    worker_options: dict = {"max_ongoing_requests": args.max_ongoing_requests,
                            "ray_actor_options": {"num_cpus": args.replica_num_cpus},
                            # ray types RequestRouterConfig's __init__ as `**kwargs: dict[str, Any]`
                            "request_router_config": RequestRouterConfig(
                                request_router_class=ROUTER_CLASS,  # type: ignore[arg-type]
                                request_routing_stats_period_s=args.routing_stats_period_s)}  # type: ignore[arg-type]
    if disaggregated:
        # bundle 0: the target (the replica itself, which must ask for bundle 0's GPU to be
        # given one); bundle 1: its DraftWorker (draft_link.draft_actor_options)
        worker_options["placement_group_bundles"] = [dict(bundle), dict(bundle)]
        worker_options["placement_group_strategy"] = "STRICT_PACK"
        worker_options["ray_actor_options"] = {"num_cpus": cpus, "num_gpus": gpus} if gpu else {"num_cpus": cpus}
    elif gpu:
        worker_options["ray_actor_options"]["num_gpus"] = 1
    if args.autoscaling:
        worker_options["autoscaling_config"] = args.autoscaling
    else:
        worker_options["num_replicas"] = args.num_replicas
    worker = TargetWorkerDeployment.options(**worker_options).bind(args)
    # The router's calls are short and never wait on generation: Serve's default of 5 at a
    # time would queue one tenant's conversation flood in front of everyone's turns.
    router = ConversationRouterDeployment.options(ray_actor_options={"num_cpus": 0},
                                                  num_replicas=args.conversations.router_replicas,
                                                  max_ongoing_requests=ROUTER_MAX_ONGOING).bind(worker, args)
    return DLiteIngressDeployment.options(**ingress_options(args)).bind(worker, router, args)


def ingress_options(args: AppArgs) -> dict:
    """The ingress deployment's options. It must take every request its tenants may have in
    flight, and then some: at Serve's default (5 ongoing requests) five streams of one tenant
    queue every other tenant, health check and metrics scrape behind them, and the per-tenant
    limit (429) never fires because the extra requests wait in Serve's queue instead."""
    limits = args.limits
    ongoing = limits.ingress_max_ongoing_requests
    if ongoing is None:
        tenants = KeyRing.load(args.api_keys_file, args.api_keys_env).num_tenants
        ongoing = tenants * limits.max_in_flight_per_tenant + limits.ingress_headroom_requests
    return {"ray_actor_options": {"num_cpus": 0}, "max_ongoing_requests": ongoing}


def pair_gpu_share(engine: EngineArgs) -> float:
    """GPUs for each of a pair's two bundles: one each, or half of one GPU each where the
    draft's tensors go through host memory (PACK places both halves on one GPU)."""
    shares_one = engine.disaggregated_draft and engine.draft != "none" and engine.draft_payload == "host"
    return 0.5 if shares_one else 1
