"""The one place that turns Prism's plain deployment classes into a Ray Serve application.

``build_app(args)`` is the ``import_path`` target of every Serve config (``services.app:build_app``); ``args.config``
is a :class:`PrismConfig` as a dict. Each served model gets its own four stage deployments (``Media``, ``Encode``,
``Prefill``, ``Decode``; suffixed ``-<served name>`` when the config lists several ``models``) and one ingress
routes to them by the request's ``model``; with ``routing.affinity`` the encode and prefill deployments get the
cache-affinity request router (:mod:`services.routers.affinity`), and decode always gets the router that sends a request
to the replica holding its KV reservation (:mod:`services.routers.pinned`). Each stage gets its own replicas, resources,
queue bound and — when its ``max_replicas`` exceeds ``min_replicas`` — a :class:`QueueDepthPolicy` autoscaler on its
own queue depth. The ingress refuses with 429 + Retry-After when its queue is full (``BackpressureConfig``).
"""

from __future__ import annotations

import secrets
from typing import Any

from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.deployment import Application

from common.config import PrismConfig, RoutingConfig, StageConfig, deployment_suffix
from services.ingress.server import IngressApp
from services.routers.affinity import AffinityRouter
from services.routers.pinned import PinnedRouter
from services.stages.decode import DecodeDeployment
from services.stages.encode import EncodeDeployment
from services.stages.media import MediaDeployment
from services.stages.prefill import PrefillDeployment


def _router(stage: str, routing: RoutingConfig) -> dict[str, Any]:
    """The cache-affinity router for a stage the ingress calls by key (encode: media, prefill: prompt prefix); for
    decode the router that sends ``generate`` to the replica holding the request's KV reservation."""
    if stage == "Decode":
        return {"request_router_config": RequestRouterConfig(request_router_class=PinnedRouter)}
    key = {"Encode": "media", "Prefill": "prefix"}.get(stage)
    if key is None or not routing.affinity:
        return {}
    kwargs = {"stage": stage.lower(), "key": key, "load_factor": routing.load_factor}
    return {
        "request_router_config": RequestRouterConfig(request_router_class=AffinityRouter, request_router_kwargs=kwargs)
    }


def _options(name: str, stage: StageConfig, retry_after_s: int) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "name": name,
        "ray_actor_options": {"num_cpus": stage.num_cpus, "num_gpus": stage.num_gpus, "resources": stage.resources},
        "max_ongoing_requests": stage.max_ongoing_requests,
        "max_queued_requests": stage.max_queued_requests,
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=retry_after_s),
    }
    if stage.max_replicas > stage.min_replicas:
        opts["autoscaling_config"] = {
            "min_replicas": stage.min_replicas,
            "max_replicas": stage.max_replicas,
            "metrics_interval_s": 1.0,
            "look_back_period_s": 5.0,
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,  # the policy applies its own downscale delay
            "policy": {
                "policy_function": "services.platform.autoscaling:QueueDepthPolicy",
                "policy_kwargs": {
                    "target_per_replica": stage.target_queue_per_replica,
                    "downscale_delay_s": stage.downscale_delay_s,
                },
            },
        }
    else:
        opts["num_replicas"] = stage.min_replicas
    return opts


def build_app(args: dict[str, Any]) -> Application:
    cfg = PrismConfig.model_validate(args.get("config", {}))
    key = cfg.observability.media_hash_key or secrets.token_hex(16)  # one key for every replica of this app
    retry = cfg.server.retry_after_s
    pipelines: list[list[Application]] = []  # per served model, in the config's order
    for sub in cfg.served():
        raw = sub.model_dump(mode="json")
        raw["observability"]["media_hash_key"] = key
        suffix = deployment_suffix(sub.model.name) if cfg.models else ""  # one model: plain names, as before
        d = sub.deployments
        pipelines.append(
            [
                serve.deployment(**_options(f"{name}{suffix}", stage, retry), **_router(name, sub.routing))(cls).bind(
                    raw
                )
                for name, stage, cls in (
                    ("Media", d.media, MediaDeployment),
                    ("Encode", d.encode, EncodeDeployment),
                    ("Prefill", d.prefill, PrefillDeployment),
                    ("Decode", d.decode, DecodeDeployment),
                )
            ]
        )
    raw = cfg.model_dump(mode="json")
    raw["observability"]["media_hash_key"] = key
    ingress = serve.deployment(**_options("Ingress", cfg.deployments.ingress, retry))(IngressApp)
    return ingress.bind(raw, pipelines)
