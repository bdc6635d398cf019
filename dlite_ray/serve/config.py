"""User-facing configuration of the Serve application (validated from deployments/*.yaml)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dlite_ray.engine.engine_config import knob_fields
from dlite_ray.serve.store_url import expand_env, parse_store_url


def _knob(name: str, **bounds: Any) -> Any:
    """The engine knob `name`, with EngineConfig's default and description (the one list) and the
    bounds a deployment is held to."""
    knob = knob_fields()[name]
    return Field(knob.default, description=knob.metadata["help"], **bounds)


class EngineArgs(BaseModel):
    """The engine each TargetWorker runs: every EngineConfig knob (its scheduler's too, flat;
    tests/serve/test_config.py fails when one is missing here), then what only Serve places."""

    model_config = ConfigDict(extra="forbid")

    target: str | None = _knob("target")
    draft: str = _knob("draft")
    # Each replica sees its GPU as cuda:0, so a deployment names the kind only.
    device: Literal["cpu", "cuda"] = _knob("device")
    dtype: Literal["auto", "float32", "bfloat16"] = _knob("dtype")
    attention_backend: Literal["auto", "sdpa", "flash_attn", "triton"] = _knob("attention_backend")
    num_draft_tokens: int = _knob("num_draft_tokens", ge=0, le=32)
    verify_block_size: int | None = _knob("verify_block_size", ge=1)
    adaptive_draft_length: bool = _knob("adaptive_draft_length")
    lookup_tokens: int | None = _knob("lookup_tokens", ge=0, le=15)
    reply_cache_tokens: int = _knob("reply_cache_tokens", ge=0)
    reply_corpus: bool = _knob("reply_corpus")
    tree_tokens: int = _knob("tree_tokens", ge=0, le=32)
    max_kv_tokens: int = _knob("max_kv_tokens", ge=1024)
    block_size: int = _knob("block_size", ge=1)
    enable_prefix_cache: bool = _knob("enable_prefix_cache")
    boundary_capacity: int = _knob("boundary_capacity", ge=0)
    tap_layers: tuple[int, ...] | None = _knob("tap_layers")
    normed_last_tap: bool | None = _knob("normed_last_tap")
    cuda_graphs: bool = _knob("cuda_graphs")
    max_num_seqs: int = _knob("max_num_seqs", ge=1)
    max_batch_tokens: int = _knob("max_batch_tokens", ge=1)

    # Serve only: where the draft runs and how the replica's threads are set.
    disaggregated_draft: bool = Field(
        True, description="run the draft in its own actor (bundle 1) over torch.distributed")
    draft_timeout_s: float = Field(
        30.0, gt=0, description="a draft round slower than this fails over to plain decoding")
    draft_max_join_failures: int = Field(
        3, ge=1, description="failed attempts in a row to join the draft actor after which the replica reports "
                             "itself degraded (/healthz, GetStats, dlite_replica_degraded); it keeps decoding "
                             "without speculation and keeps trying")
    draft_payload: Literal["dist", "host"] = Field(
        "dist", description="how a round's tensors reach the draft actor: 'dist' over torch.distributed (NCCL, one "
                            "GPU each; gloo on CPU), 'host' through host memory on the control socket (target and "
                            "draft share one GPU, half of it each: NCCL refuses two ranks on one device)")
    cpu_threads: int | None = Field(
        None, ge=1, description="torch threads of the target on CPU; null = follow the load: every core the worker "
                                "may run on while one request runs, all but one (left to the ingress, proxy and "
                                "draft) when more do (not Ray's logical num_cpus, 0 on small machines)")
    draft_cpu_threads: int = Field(
        1, ge=1, description="torch threads of the draft actor on CPU: one by default, so that its idle OpenMP "
                            "threads do not spin against the target's forward")


class LimitArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens_cap: int = Field(1024, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request names none")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="largest request accepted: an HTTP body's bytes, a "
                                                             "gRPC message's serialized bytes (HTTP 413 / gRPC "
                                                             "INVALID_ARGUMENT)")
    max_messages: int = Field(512, ge=1, description="most chat messages in one request")
    max_message_chars: int = Field(
        128 << 10, ge=1, description="most characters in one message's content (a tool result included); "
                                     "checked before anything is tokenized (HTTP 413 / gRPC INVALID_ARGUMENT)")
    max_prompt_chars: int = Field(
        256 << 10, ge=1, description="most characters in one prompt: every message (the tools' schemas "
                                     "included) or the completion prompt, and a conversation's stored history "
                                     "with the messages a turn adds; checked before anything is tokenized, so "
                                     "tokenizing one prompt stays short (HTTP 413 / gRPC INVALID_ARGUMENT)")
    max_in_flight_per_tenant: int = Field(
        8, ge=1, description="generation requests one tenant (API key) may have in flight at once, per ingress "
                             "replica; more get HTTP 429 / gRPC RESOURCE_EXHAUSTED")
    ingress_max_ongoing_requests: int | None = Field(
        None, ge=1, description="requests one ingress replica takes at once (every route and RPC; a stream for "
                                "its whole length); Serve queues the rest in front of it, so too low a value "
                                "lets one tenant's streams stall everyone. null = max_in_flight_per_tenant x "
                                "the tenants with keys (1 without keys) + ingress_headroom_requests")
    ingress_headroom_requests: int = Field(
        32, ge=1, description="requests an ingress replica takes beyond its tenants' generation slots (when "
                              "ingress_max_ongoing_requests is null): /healthz, /metrics, conversation reads, "
                              "and the requests it refuses at once with 429")


class ConversationArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    store_path: str = Field("dlite-conversations.sqlite3", description="SQLite file of the durable histories "
                                                                       "(when store_url is null)")
    store_url: str | None = Field(
        None, description="where the durable histories live: sqlite:///PATH (a file on the router's node) or "
                          "postgresql://USER@HOST:PORT/DB (a server every router replica shares, so histories "
                          "outlive a node; password from PGPASSWORD or ~/.pgpass); ${NAME} in it is the "
                          "environment variable NAME of the process that opens the store (\"${DLITE_STORE_URL}\": "
                          "the URL from a Secret, never in this file); null = the SQLite file store_path")
    router_replicas: int = Field(
        1, ge=1, description="ConversationRouter replicas; more than one need store_url postgresql://... . Each "
                             "is stateless beyond the store (claims, leases and which replica holds a "
                             "conversation's KV live there), so a turn goes on through either when one dies")
    retention_days: float | None = Field(
        None, gt=0, description="conversations no turn has touched for this many days are deleted with their "
                                "histories (SQLite overwrites the text in the file; PostgreSQL frees it at "
                                "VACUUM, see cluster/README.md); null = kept until deleted")
    default_lease_s: float = Field(300.0, gt=0, description="how long a paused conversation's KV is held")
    max_lease_s: float = Field(3600.0, gt=0, description="the longest lease a request may ask for")
    max_conversations_per_tenant: int = Field(
        1000, ge=1, description="conversations one tenant (API key) may keep at once; creating one more gets "
                                "HTTP 429 / gRPC RESOURCE_EXHAUSTED naming the limit, until it deletes some")
    max_stored_bytes_per_tenant: int = Field(
        256 << 20, ge=1, description="bytes of conversation history (as stored, UTF-8 JSON) one tenant may keep "
                                     "across its conversations; a create or a turn's messages that would pass it "
                                     "get HTTP 429 / gRPC RESOURCE_EXHAUSTED naming the limit (a turn's reply is "
                                     "stored whatever its size)")

    @field_validator("store_url")
    @classmethod
    def _known_store(cls, url: str | None) -> str | None:
        if url is not None:
            # ValueError: an unset ${NAME}; what is accepted, the URL without its password
            parse_store_url(expand_env(url))
        return url

    @model_validator(mode="after")
    def _replicas_share_the_store(self) -> ConversationArgs:
        if self.router_replicas > 1 and parse_store_url(self.store_location())[0] != "postgresql":
            raise ValueError(f"conversations.router_replicas = {self.router_replicas} needs a store every replica "
                             f"shares: set conversations.store_url to postgresql://... (a SQLite file lives on "
                             f"one node)")
        return self

    def store_location(self) -> str:
        """The store's URL (its ${NAME}s expanded from this process's environment): store_url,
        else the SQLite file store_path."""
        return expand_env(self.store_url) if self.store_url is not None else f"sqlite:///{self.store_path}"


class AppArgs(BaseModel):
    """Arguments of `dlite_ray.serve.app:build_app` (the `args:` block of the Serve YAML)."""

    # errors name the field and the reason, not the value: conversations.store_url may hold a password
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    engine: EngineArgs = Field(default_factory=EngineArgs, description="the engine each TargetWorker runs")
    limits: LimitArgs = Field(default_factory=LimitArgs, description="request limits enforced by the ingress")
    conversations: ConversationArgs = Field(default_factory=ConversationArgs, description="the conversation registry")
    api_keys_file: str | None = Field(None, description="file of 'key tenant' lines; none = local single-tenant mode")
    api_keys_env: str | None = Field("DLITE_API_KEYS", description="env var of 'key:tenant,...' pairs")
    require_draft: bool = Field(
        False, description="a TargetWorker whose draft has not joined (degraded, see "
                           "engine.draft_max_join_failures) fails its health check, so Serve routes nothing to it "
                           "and replaces it; false: it serves, decoding without speculation, and reports itself "
                           "degraded")
    model_name: str = Field("dlite-smollm2-135m", description="the model id served in /v1/models")
    num_replicas: int | None = Field(1, ge=1, description="fixed TargetWorker replicas (ignored with autoscaling)")
    autoscaling: dict | None = Field(None, description="Serve autoscaling_config for TargetWorker pairs")
    max_ongoing_requests: int = Field(64, ge=1, description="requests a TargetWorker takes at once")
    replica_num_cpus: float = Field(0, ge=0, description="logical CPUs per replica (0 on small CPU machines)")
    routing_stats_period_s: float = Field(2.0, gt=0, description="how often TargetWorker replicas publish free KV "
                                          "and held conversations to the affinity router")
    accelerator_type: str | None = Field(None, description="e.g. H800: pin pairs to that GPU type")
    ops_tenants: list[str] | None = Field(
        None, description="tenants whose API keys may read operational figures (/metrics; GetStats' replica, KV "
                          "and lease figures); null = any API key. Without keys configured they are open. "
                          "/healthz (and GetStats without a key) only say ok or unavailable; /docs and "
                          "/openapi.json are not served")
    worker_probe_timeout_s: float = Field(
        2.0, gt=0, description="how long /healthz, /metrics and GetStats wait for a TargetWorker's stats; a "
                               "worker that does not answer in time reads as unavailable (HTTP 503 on /healthz)")
    worker_probe_ttl_s: float = Field(
        1.0, ge=0, description="how long one answer of the workers serves /healthz, /metrics and GetStats")
