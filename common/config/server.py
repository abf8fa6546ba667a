"""``server:`` — the HTTP/gRPC front door: API keys, deadlines, body and request-shape limits, retries."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, field_validator

from common.config.base import Strict

_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DRAIN_MOVE_S = 10.0
"""Time a stopping decode replica is given past ``drain_grace_s`` for its remaining streams to move (their chains
issued again and replayed elsewhere) before Serve may kill it."""
SERVE_GRACEFUL_S = 20.0
"""Serve's own ``graceful_shutdown_timeout_s``: a stopping ingress or decode replica never gets less."""


def _check_tenants(keys: dict[str, str]) -> dict[str, str]:
    for n, tenant in enumerate(keys.values(), 1):
        if not _TENANT.match(tenant):  # never quoted: a map written the wrong way round has a key here
            raise ValueError(f"the tenant name of entry {n} must be 1-64 letters, digits, '_', '.' or '-'")
    return keys


class ServerConfig(Strict):
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
    """How visual embeddings and KV move between stages (a model's own ``transport`` wins): ``object_store`` — in
    the stage responses, through Ray's object store; ``nixl`` — NIXL agents owned by the replicas (UCX, RDMA where
    the NIC has it) read them straight into registered memory (:mod:`common.kv.transport`)."""
    max_body_bytes: int | None = Field(default=None, ge=1024)
    """Largest request body (HTTP) or message (gRPC) accepted, in bytes; bigger ones get 413 ``request_too_large``
    while they are read — in Serve's HTTP proxy already (:mod:`services.platform.proxy_guard`). ``None``: what the other
    limits allow — ``media.max_request_bytes`` of images as base64 data URLs, plus ``max_text_chars`` of text at up to 8
    bytes each as JSON escapes, plus 1 MiB for the JSON around them (≈ 87 MiB with the defaults)."""
    max_body_bytes_in_flight: int | None = Field(default=None, ge=1024)
    """Request-body bytes one ingress replica holds at once — bodies being read and parsed, over every request: a
    request whose declared body would go past it is refused 429 ``server_overloaded`` + Retry-After before a byte of it
    is read (its tenant's other requests and every other tenant's keep their memory). ``None``: four bodies at the
    limit (``4 × max_body_bytes``)."""
    body_read_grace_s: float = Field(default=10.0, gt=0)
    """Seconds any request body may take to arrive; past them it must keep arriving at ``body_min_bytes_per_s`` on
    average since its first byte, or the client gets 408 ``request_timeout`` and the request is dropped — in Serve's
    HTTP proxy already, before (or while) the ingress reads it: a slow or stalled upload cannot hold its places,
    memory or sockets for long."""
    body_min_bytes_per_s: int = Field(default=65_536, ge=1)
    """Slowest average rate a request body may arrive at once ``body_read_grace_s`` has passed (64 KiB/s, half a
    megabit: a body at the limit may take its grace plus ~23 minutes at that rate; anything slower is a client that
    is not sending)."""
    front_places: int | None = Field(default=None, ge=1)
    """Requests one Serve proxy carries at once before it shares them out between tenants (requests of applications
    with API keys, counted from when the key is checked — before the body is read — until the response ends). Past
    them, a tenant below its fair share of the places (split by ``admission.tenants.<name>.weight`` between the
    tenants that want them) still gets in at once, and a tenant at its share waits, its body unread, in a queue of its
    own (``front_max_waiting``); a tenant alone may use them all. ``None``: what the ingress carries at most,
    ``max_in_flight_per_ingress`` × ``deployments.ingress.max_replicas``."""
    front_max_waiting: int = Field(default=128, ge=0)
    """Requests of one tenant that may wait at a Serve proxy for a place; more get 429 ``tenant_share_exceeded`` +
    Retry-After."""
    proxy_chunked_bytes_in_flight: int | None = Field(default=None, ge=1024)
    """Bytes of uploads without a ``Content-Length`` (chunked) that one Serve proxy gathers at once, over every
    request: a chunk that would go past them gets its request a 503 ``server_overloaded`` + Retry-After. ``None``:
    four bodies at the limit."""
    max_concurrent_grpc_calls: int = Field(default=1024, ge=1)
    """gRPC calls one Serve proxy serves at once; more get ``RESOURCE_EXHAUSTED`` before their message is read."""
    max_json_depth: int = Field(default=32, ge=8, le=256)
    """Deepest JSON nesting accepted in a request body (400 ``json_too_deep``)."""
    max_json_structure: int | None = Field(default=None, ge=64)
    """Structural characters (``{ [ , :``) a request body may hold, counted on its bytes before it is parsed (400
    ``json_too_wide``): a body of a million empty objects is cheap to send and costs its parser ~27× its size in
    Python objects while it holds the GIL — every stream on the replica stalls meanwhile. Base64 holds none of these
    characters, so a large image costs nothing here. ``None``: what the shape limits allow — 8 per content part of
    every message, plus every text character (text may be all punctuation), plus 4096."""
    max_response_format_bytes: int = Field(default=65_536, ge=256)
    """Largest output constraint (``response_format`` / ``structured_outputs`` / ``guided_*``, as JSON) accepted;
    larger is a 400 ``invalid_response_format``. Compiling is bounded too (:mod:`common.grammar.compiler`)."""
    max_tools_bytes: int = Field(default=65_536, ge=256)
    """Largest ``tools`` list (function definitions, as JSON) accepted; larger is a 400 ``invalid_tools``. The
    definitions enter the prompt (counted in its tokens) and their schemas compile like a ``response_format``."""
    max_tool_calls: int = Field(default=16, ge=1)
    """Calls in one answer, at most (with ``parallel_tool_calls``): the grammar ends the answer after that many, so an
    answer of calls whose arguments' schemas are bounded always ends."""
    max_n: int = Field(default=8, ge=1, le=128)  # (128: the engines' bound, SamplingParams.n)
    """Choices (``n``) one request may ask for; more is a 400 ``too_many_choices``. Its KV is the prompt's full blocks
    once plus each choice's own (within the per-request lease), its output ``n`` × ``max_tokens``."""
    max_unknown_fields: int = Field(default=64, ge=0)
    """Top-level fields Prism does not know (vendor extensions, ``user``, ``metadata`` …) accepted in one request;
    more are a 400 ``too_many_fields``."""
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
    drain_grace_s: float = Field(default=5.0, ge=0, le=300)
    """How long the decode streams of a replica that is leaving (autoscaler scale-down, rolling update, node drain:
    Serve stops routing to it, then waits for its calls) may go on there before the ingress moves each one still
    running to a live replica of its deployment by migration (replayed, unseen by the client; one of
    ``max_migrations``). Short streams finish where they are; a stopping ingress or decode replica is given this plus
    :data:`DRAIN_MOVE_S` (at least Serve's 20 s) before Serve may kill it — a stream that cannot move (``n`` > 1,
    migrations spent) and runs longer is cut then. With no live replica to move to yet, the stream stays until one
    answers (or its replica exits: then it migrates as a lost one would)."""

    @property
    def json_structure_limit(self) -> int:
        """``max_json_structure``, or what the shape limits allow (see that field)."""
        if self.max_json_structure is not None:
            return self.max_json_structure
        return 8 * self.max_messages * self.max_content_parts + self.max_text_chars + 4096

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
