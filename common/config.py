"""Pydantic configuration for Prism.

Every field has a docstring; unknown fields are refused (``extra="forbid"``), so a typo in a YAML file is an error
at load time, not a silently ignored setting. Nothing here reads the environment at import; callers load a config
explicitly (``PrismConfig.model_validate(yaml_dict)``) — the media section reads
``PRISM_MEDIA_ALLOWED_PRIVATE_NETWORKS`` at that moment.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.media.config import MediaConfig
from common.sched.resources import AdmissionConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """Which model to serve and how to load it."""

    model: str = "prism-tiny-llava"
    """An embedded model name (``prism-tiny-llava``, ``prism-tiny-qwen2vl``, ``prism-small-*``) or a local HF
    checkpoint directory of a supported family."""
    served_name: str | None = None
    """Name clients use in the ``model`` field; defaults to ``model`` (or the directory's name)."""
    cache_dir: str = "~/.cache/prism/models"
    """Where embedded models are built on first use."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights/activation dtype; ``auto`` takes the checkpoint's own dtype."""
    torch_threads: int | None = Field(default=None, ge=1)
    """torch intra-op threads for this process; set it to the replica's CPU share so replicas don't fight."""

    @property
    def name(self) -> str:
        """The name clients use (what :func:`common.model.loader.load_frontend` serves it as)."""
        if self.served_name:
            return self.served_name
        path = Path(self.model).expanduser()
        return path.resolve().name if path.is_dir() else self.model


class EngineConfig(_Strict):
    """Engine settings of the encode, prefill and decode stages."""

    kv_block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV block; KV travels from prefill to decode in blocks of this size."""
    max_prompt_tokens: int = Field(default=4096, ge=1)
    """Prompts longer than this (after placeholder expansion) are refused with a 400."""
    max_output_tokens: int = Field(default=1024, ge=1)
    """Upper bound on a request's ``max_tokens``."""
    kv_pool_blocks: int = Field(default=2048, ge=1)
    """KV blocks in each decode replica's pool."""
    max_lease_fraction: float = Field(default=0.5, gt=0, le=1)
    """Largest share of the pool one request may lease."""
    max_batch: int = Field(default=32, ge=1)
    """Sequences decoded per step."""
    prefill_chunk_tokens: int = Field(default=512, ge=1)
    """Prompt tokens computed per prefill step (a media span is kept whole where the model family asks for it)."""
    prefix_cache_blocks: int = Field(default=1024, ge=0)
    """KV blocks the prefill stage keeps for its prefix cache (0 disables it)."""
    encoder_cache_bytes: int = Field(default=256 << 20, ge=0)
    """Bytes of visual embeddings the encode stage caches (0 disables it)."""
    processor_cache_bytes: int = Field(default=512 << 20, ge=0)
    """Bytes of processed pixel arrays the media stage caches (0 disables it)."""
    encoder_patch_budget: int = Field(default=16_384, ge=1)
    """Vision patches per encoder batch."""
    shared_cache_scope: bool = False
    """Share processor/encoder/prefix caches across tenants (only for single-tenant deployments)."""

    @property
    def max_lease_blocks(self) -> int:
        """KV blocks one request may lease in a decode pool (what :class:`common.kv.pool.KVPool` allows)."""
        return max(1, int(self.kv_pool_blocks * self.max_lease_fraction))


class StageConfig(_Strict):
    """Replicas, resources and queue bounds of one deployment."""

    min_replicas: int = Field(default=1, ge=0)
    """Autoscaling floor (and the replica count when ``max_replicas == min_replicas``)."""
    max_replicas: int = Field(default=1, ge=1)
    """Autoscaling ceiling; above ``min_replicas`` the stage autoscales on its own queue depth."""
    target_queue_per_replica: float = Field(default=4.0, gt=0)
    """Queue depth (in the stage's own unit) one replica should carry before another is added."""
    downscale_delay_s: float = Field(default=30.0, ge=0)
    """How long the queue must stay low before a replica is removed (no flapping)."""
    num_cpus: float = Field(default=0.25, ge=0)
    """CPUs reserved per replica."""
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs per replica."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources per replica: pins the stage to the nodes (worker groups) that advertise them."""
    max_ongoing_requests: int = Field(default=32, ge=1)
    """Requests a replica works on at once."""
    max_queued_requests: int = Field(default=64, ge=-1)
    """Requests waiting for a replica before callers get 429 (-1: unbounded)."""
    cpu_nice: int = Field(default=0, ge=0, le=19)
    """OS scheduling niceness the replica's threads are raised to (never lowered: Ray starts workers at 15). Where
    stages share CPU cores (a CPU-only node; media replicas beside the LM engines' host threads), a higher value on
    the throughput stages (media, encode) gives the latency path (ingress, prefill, decode) the cores first, so a
    flood of large images cannot slow short requests through the CPU scheduler. 0 leaves the priority alone."""

    @model_validator(mode="after")
    def _range(self) -> StageConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be ≥ min_replicas")
        return self


# Per-stage defaults (a config that sets only some fields of a stage keeps the others' stage defaults). The stage
# budgets (`admission:`) bound the work inside a replica; `max_ongoing_requests` is set well above Serve's default so
# requests waiting for room in a budget (ranked there) rarely fill the replica and leave the calls behind them in
# Serve's router queue, which is first come, first served.


class MediaStageConfig(StageConfig):
    max_ongoing_requests: int = Field(default=128, ge=1)
    """Requests a replica works on at once (the pixel budget bounds what decodes)."""
    cpu_nice: int = Field(default=19, ge=0, le=19)
    """OS niceness: media decoding yields the cores to the latency path (see :class:`StageConfig`)."""


class EncodeStageConfig(StageConfig):
    max_ongoing_requests: int = Field(default=128, ge=1)
    """Requests a replica works on at once (the patch budget bounds what encodes)."""
    cpu_nice: int = Field(default=18, ge=0, le=19)
    """OS niceness: the encoder yields the cores to the latency path (see :class:`StageConfig`)."""


class PrefillStageConfig(StageConfig):
    max_ongoing_requests: int = Field(default=128, ge=1)
    """Requests a replica works on at once (the token budget bounds what computes)."""
    long_lane_nice: int = Field(default=18, ge=0, le=19)
    """OS niceness of the thread that prefills prompts with media or over ``admission.lane_max_prompt_tokens``;
    the low-latency lane's thread keeps the replica's own (see :class:`StageConfig`)."""


class DecodeStageConfig(StageConfig):
    max_ongoing_requests: int = Field(default=64, ge=1)
    """Sequences a replica streams at once."""


def deployment_suffix(served_name: str) -> str:
    """A served model's name as the suffix of its deployments' names (letters, digits, ``_`` and ``-`` only)."""
    return "-" + re.sub(r"[^A-Za-z0-9_-]", "_", served_name)


class ModelStages(_Strict):
    """The four stage deployments that serve one model."""

    media: MediaStageConfig = MediaStageConfig()
    encode: EncodeStageConfig = EncodeStageConfig()
    prefill: PrefillStageConfig = PrefillStageConfig()
    decode: DecodeStageConfig = DecodeStageConfig()


class IngressStageConfig(StageConfig):
    num_cpus: float = Field(default=0.1, ge=0)
    """CPUs reserved per replica."""
    max_ongoing_requests: int = Field(default=512, ge=1)
    """Requests a replica works on at once (keep it above ``server.max_in_flight_per_ingress``)."""
    max_queued_requests: int = Field(default=128, ge=-1)
    """Requests waiting for a replica before callers get Serve's own 429 (-1: unbounded)."""


class DeploymentsConfig(ModelStages):
    """Every deployment of a one-model application: the ingress and the model's stages."""

    ingress: IngressStageConfig = IngressStageConfig()


class ServedModel(ModelConfig):
    """One model of a several-model application (an entry of ``models:``): its source, dtype, name and its own
    stage deployments — media included, so each model's processor and processor cache live in replicas of its own."""

    deployments: ModelStages = ModelStages()
    """This model's media, encode, prefill and decode deployments."""

    def model_only(self) -> ModelConfig:
        return ModelConfig(**self.model_dump(exclude={"deployments"}))


_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _check_tenants(keys: dict[str, str]) -> dict[str, str]:
    for n, tenant in enumerate(keys.values(), 1):
        if not _TENANT.match(tenant):  # never quoted: a map written the wrong way round has a key here
            raise ValueError(f"the tenant name of entry {n} must be 1-64 letters, digits, '_', '.' or '-'")
    return keys


class ServerConfig(_Strict):
    """HTTP/gRPC front door."""

    api_keys: dict[str, str] = Field(default_factory=dict)
    """API key → tenant (letters, digits, ``_ . -``). Neither this nor ``api_keys_file``: no authentication, every
    request is tenant ``default``. (Where the proxies listen is the Serve config's ``http_options`` /
    ``grpc_options``, not Prism's.)"""
    api_keys_file: str | None = Field(default=None, min_length=1)
    """A JSON/YAML file mapping API key → tenant (e.g. a mounted Kubernetes Secret), merged with ``api_keys``; keys
    kept out of the Serve config itself. Set: authentication is on even while the file holds no key (everyone is
    refused), and the file is re-read when it changes (key rotation without a restart, see :mod:`common.auth`)."""
    api_keys_reload_s: float = Field(default=5.0, ge=0)
    """How often, at most, an ingress replica checks ``api_keys_file`` for a change (a ``stat``; 0: on every
    request). A rotated key takes effect, and a removed one stops working, within this long."""
    default_deadline_ms: int = Field(default=120_000, ge=1)
    """Budget of a request that sends no ``X-Prism-Deadline-Ms``."""
    max_deadline_ms: int = Field(default=600_000, ge=1)
    """Largest budget a client may ask for."""
    retry_after_s: int = Field(default=1, ge=1)
    """Retry-After on 429."""
    max_in_flight_per_ingress: int = Field(default=256, ge=1)
    """Requests one ingress replica carries at once; more get 429 with an OpenAI error body (keep it below the
    ingress's ``max_ongoing_requests`` so Serve's own, body-less backpressure is only the last line of defence)."""
    transport: Literal["object_store", "nixl"] = "object_store"
    """How embeddings and KV move between stages."""
    max_body_bytes: int | None = Field(default=None, ge=1024)
    """Largest request body (HTTP) or message (gRPC) accepted, in bytes; bigger ones get 413 ``request_too_large``
    while they are read — in Serve's HTTP proxy already (:mod:`services.proxy_guard`). ``None``: what the other limits
    allow — ``media.max_request_bytes`` of images as base64 data URLs, plus ``max_text_chars`` of text at up to 8
    bytes each as JSON escapes, plus 1 MiB for the JSON around them (≈ 87 MiB with the defaults)."""
    max_json_depth: int = Field(default=32, ge=8, le=256)
    """Deepest JSON nesting accepted in a request body (400 ``json_too_deep``)."""
    max_messages: int = Field(default=256, ge=1)
    """Messages in one request (400 ``too_many_messages``)."""
    max_content_parts: int = Field(default=64, ge=1)
    """Content parts in one message (400 ``too_many_content_parts``)."""
    max_text_chars: int = Field(default=131_072, ge=1)
    """Characters of text across all messages, checked before tokenising (400 ``text_too_long``)."""
    max_chain_attempts: int = Field(default=3, ge=1, le=10)
    """Times the ingress issues a request's stage chain when a replica is lost before the first token id comes
    back (jittered backoff between attempts; never past the deadline). A typed error is never retried."""
    max_migrations: int = Field(default=2, ge=0, le=10)
    """Times one request's decode stream may move to a live replica after its own was lost mid-generation (the
    chain is issued again and the tokens already sent are replayed, so the client sees neither error nor repeat).
    0: a lost decode replica fails its requests (503, or an error event in a stream)."""

    @field_validator("api_keys")
    @classmethod
    def _tenants(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_tenants(v)


def read_keys_file(path: str) -> dict[str, str]:
    """API key → tenant from a JSON/YAML file; ``OSError`` when it cannot be read, ``ValueError`` when malformed. An
    empty file holds no keys."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:  # its message quotes the offending line, which may hold a key: say where only
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"{path} is not valid JSON/YAML{where}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ValueError(f"{path} must map API keys (strings) to tenant names")
    return _check_tenants(raw)


class ObservabilityConfig(_Strict):
    """Request traces and the request log (metrics need no settings: they go to Ray's metrics port)."""

    media_hash_key: str = ""
    """Secret key of the keyed hash that names media in traces and logs (HMAC of the bytes' digest). Empty: the app
    builder draws a random one per deployment of the application (hashes then correlate only within it)."""
    request_log: bool = True
    """Write one JSON line per finished request (ids, shapes, cache outcomes, timings; never content)."""
    request_log_path: str | None = None
    """Append the request log to this file instead of the ingress replica's stderr (which Ray keeps in its worker
    logs)."""
    allow_client_traces: bool = True
    """Honour ``X-Prism-Trace: 1`` (return the trace in the response). Off: the header is ignored."""
    trace_cache_hits: bool = False
    """Client traces carry cache outcomes (processor/encoder hits and misses, prefix-cached tokens, prefill chunks).
    Off by default: a hit tells a caller that someone sharing its cache scope (its tenant, or every tenant with
    ``engine.shared_cache_scope``) sent the same image or prompt prefix. The request log and the metrics keep them
    either way; the local configs and the load generator turn it on."""


class BatchConfig(_Strict):
    """The offline video batch job (``python -m services.batch``): Ray Data stage sizes and output cadence."""

    media_concurrency: int = Field(default=2, ge=1)
    """CPU tasks fetching, decoding and processing clips at once."""
    media_num_cpus: float = Field(default=0.5, gt=0)
    """CPUs per media task."""
    encode_actors: int = Field(default=1, ge=1)
    """Encode actors (each holds the vision tower)."""
    encode_batch_size: int = Field(default=4, ge=1)
    """Clips per encode call (one vision-tower batch)."""
    encode_num_gpus: float = Field(default=0.0, ge=0)
    """GPUs per encode actor."""
    generate_actors: int = Field(default=1, ge=1)
    """Prefill + decode actors (each holds the language model and a KV pool)."""
    generate_batch_size: int = Field(default=8, ge=1)
    """Clips decoded together (continuous batching within the batch)."""
    generate_num_gpus: float = Field(default=0.0, ge=0)
    """GPUs per generate actor."""
    actor_num_cpus: float = Field(default=0.5, gt=0)
    """CPUs per encode / generate actor (actors hold theirs for the whole job: media tasks need room beside them)."""
    default_max_tokens: int = Field(default=128, ge=1)
    """Output tokens for rows without ``max_tokens``."""
    model: str | None = None
    """With several ``models:``, the one (its served name) the batch job runs; ``None``: the first that takes video."""
    write_every_rows: int = Field(default=16, ge=1)
    """Rows per output part file: a killed job loses at most this many finished rows plus those in flight."""
    progress_interval_s: float = Field(default=10.0, gt=0)
    """Seconds between progress lines (one is also written with every part)."""


class RoutingConfig(_Strict):
    """Cache-affinity routing of the encode and prefill calls (:mod:`common.sched.affinity`,
    :mod:`services.routing`)."""

    affinity: bool = True
    """Send a media item's encode call, and a prompt's prefill call, to the replica whose cache holds them (bounded
    by load); off: Serve's default power-of-two-choices router."""
    load_factor: float = Field(default=1.25, ge=1.0, le=10.0)
    """The most a replica may carry, as a multiple of the stage's average (requests in flight, and a new key's
    share of recent requests), before work meant for it goes to another replica."""
    prefix_key_tokens: int = Field(default=32, ge=1)
    """Text tokens of a text-only prompt's start that its prefill routing key covers (a prompt with media is keyed
    through its first media item)."""


class PrismConfig(_Strict):
    """Top-level configuration (the ``args.config`` of the Serve application).

    One model: ``model`` and ``deployments``. Several: ``models`` (a list of :class:`ServedModel`, each with its own
    stage deployments) and ``deployments.ingress``; the ingress routes each request by its ``model`` field."""

    model: ModelConfig = ModelConfig()
    models: list[ServedModel] = Field(default_factory=list)
    """Several models in one application; leave ``model`` out then (and give each model its stages here)."""
    engine: EngineConfig = EngineConfig()
    media: MediaConfig = Field(default_factory=MediaConfig)
    admission: AdmissionConfig = AdmissionConfig()
    server: ServerConfig = ServerConfig()
    deployments: DeploymentsConfig = DeploymentsConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    batch: BatchConfig = BatchConfig()
    routing: RoutingConfig = RoutingConfig()

    @model_validator(mode="after")
    def _one_or_several(self) -> PrismConfig:
        if not self.models:
            return self
        if self.model != ModelConfig():  # (a dumped config carries the default `model` beside its `models`)
            raise ValueError("give either `model` (one model) or `models` (several), not both")
        default = DeploymentsConfig()
        stray = [n for n in ModelStages.model_fields if getattr(self.deployments, n) != getattr(default, n)]
        if stray:
            raise ValueError(
                f"with `models`, each model's stages go under models[i].deployments, not deployments.{sorted(stray)[0]}"
            )
        for names in ([m.name for m in self.models], [deployment_suffix(m.name) for m in self.models]):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(
                    f"models must have distinct names (also as deployment names); {twice[0]!r} appears twice"
                )
        return self

    def served(self) -> list[PrismConfig]:
        """One single-model config per served model (what its stage deployments and its ingress client take): the
        config itself when it has one model."""
        if not self.models:
            return [self]
        ingress = self.deployments.ingress
        return [
            self.model_copy(
                update={
                    "model": m.model_only(),
                    "models": [],
                    "deployments": DeploymentsConfig(ingress=ingress, **dict(m.deployments)),
                }
            )
            for m in self.models
        ]

    @property
    def body_limit(self) -> int:
        """``server.max_body_bytes``, or what the media and text limits allow (see that field)."""
        if self.server.max_body_bytes is not None:
            return self.server.max_body_bytes
        media = min(self.media.max_request_bytes, self.media.max_items_per_request * self.media.max_item_bytes)
        return 4 * -(-media // 3) + 8 * self.server.max_text_chars + (1 << 20)
