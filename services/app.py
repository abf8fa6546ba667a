"""The one place that turns Prism's plain deployment classes into a Ray Serve application.

``build_app(args)`` is the ``import_path`` target of every Serve config (``services.app:build_app``); ``args.config`` is
a :class:`PrismConfig` as a dict. Each served model gets one deployment per group of its ``deployments.topology``
(:mod:`common.config.topology`), after a ``Media`` deployment of its own unless the topology groups media with encode:
``Media``, ``Encode``, ``Prefill``, ``Decode`` for the default ``E/P/D``; ``Media``, ``Encode`` and ``PrefillDecode``
for ``E/PD``; ``Media``, ``EncodePrefill`` and ``Decode`` for ``EP/D``; ``Media`` and ``EncodePrefillDecode`` for
``EPD``; ``MediaEncode``, ``Prefill`` and ``Decode`` for ``ME/P/D``; ``MediaEncode`` and ``PrefillDecode`` for
``ME/PD``; ``MediaEncodePrefillDecode`` for ``MEPD`` (a grouped one is :class:`services.stages.group.GroupDeployment`) —
suffixed ``-<served name>`` when the config lists several ``models`` — and one ingress routes to them by the request's
``model``. A model with ``deployments.in_ingress`` (topology ``MEPD``) has no deployment: each ingress replica builds
its group and calls it in process, and asks for the group's CPUs, GPUs and resources on top of its own. With
``routing.affinity`` a group led by media, encode or prefill gets the cache-affinity request router
(:mod:`services.routers.affinity`); decode alone always gets the router that sends a request to the replica holding its
KV reservation (:mod:`services.routers.pinned`). Each deployment gets its own replicas, resources, queue bound and —
when its ``max_replicas`` exceeds ``min_replicas`` — a :class:`QueueDepthPolicy` autoscaler on its own queue depth. The
ingress refuses with 429 + Retry-After when its queue is full (``BackpressureConfig``). Rolling updates start each
replacement before the replica it replaces stops (``max_surge_percent``); a stopping ingress or decode replica is given
the drain grace and time to move its streams (``_stopping_s``; the decode streams that can move are moved after
``server.drain_grace_s``: :mod:`services.ingress.leaving`).
"""

from __future__ import annotations

import secrets
from typing import Any

from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.deployment import Application

from common.config import PrismConfig, RoutingConfig, StageConfig, deployment_suffix
from common.config.server import DRAIN_MOVE_S, SERVE_GRACEFUL_S
from common.config.topology import Group, group_name, groups, media_apart
from services.ingress.server import IngressApp
from services.routers.affinity import AffinityRouter
from services.routers.pinned import PinnedRouter
from services.stages.decode import DecodeDeployment
from services.stages.encode import EncodeDeployment
from services.stages.group import GroupDeployment
from services.stages.media import MediaDeployment
from services.stages.prefill import PrefillDeployment


def _router(group: Group, routing: RoutingConfig) -> dict[str, Any]:
    """The router of a deployment holding ``group``: decode alone gets the router that sends ``generate`` to the
    replica holding the request's KV reservation; otherwise, with ``routing.affinity``, the cache-affinity router keyed
    by the group's first stage (media or encode: the media, for the encoder's cache; prefill: the prompt prefix). A
    group that ends with decode reserves the KV in the replica that prefills, so it needs no pinning; without affinity
    it still gets the pinned router (routing like Serve's default) so that its replica set reaches the ingress."""
    if group == ("decode",) or (group[-1] == "decode" and not routing.affinity):  # (see PinnedRouter)
        return {"request_router_config": RequestRouterConfig(request_router_class=PinnedRouter)}
    lead = "encode" if group[0] == "media" else group[0]  # (a media stage is grouped with encode: the cache it feeds)
    key = {"encode": "media", "prefill": "prefix"}[lead]
    if not routing.affinity:
        return {}
    kwargs: dict[str, Any] = {"stage": lead, "key": key, "load_factor": routing.load_factor}
    if key == "media" and "prefill" in group:  # (a text request has no media: it goes by its prompt's prefix)
        kwargs["fallback"] = "prefix"
    return {
        "request_router_config": RequestRouterConfig(request_router_class=AffinityRouter, request_router_kwargs=kwargs)
    }


_SINGLE: dict[str, type] = {"encode": EncodeDeployment, "prefill": PrefillDeployment, "decode": DecodeDeployment}


def _stage_app(group: Group, sub: PrismConfig, suffix: str, retry: int, raw: dict) -> Any:
    """The bound deployment of one group of a model's topology: the stage's own class, or a grouped one."""
    opts = _options(f"{group_name(group)}{suffix}", sub.deployments.group_stage(group), retry)
    if "decode" in group:  # (see _stopping_s)
        opts["graceful_shutdown_timeout_s"] = _stopping_s(sub)
    deployment = serve.deployment(**opts, **_router(group, sub.routing))
    if len(group) == 1:
        return deployment(_SINGLE[group[0]]).bind(raw)
    return deployment(GroupDeployment).bind(raw, group)


def _options(name: str, stage: StageConfig, retry_after_s: int) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "name": name,
        "ray_actor_options": {"num_cpus": stage.num_cpus, "num_gpus": stage.num_gpus, "resources": stage.resources},
        "max_ongoing_requests": stage.max_ongoing_requests,
        "max_queued_requests": stage.max_queued_requests,
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=retry_after_s),
        "max_surge_percent": stage.max_surge_percent,
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


def _stopping_s(cfg: PrismConfig) -> float:
    """How long Serve waits for a stopping ingress or decode replica's calls before it kills it: the drain grace, time
    for the moves after it, and never less than Serve's own default. Not longer: on a node being drained, Serve stops a
    replica at once — before its replacement runs elsewhere — when its graceful timeout would not end before the
    node's deadline (the chart's ``drain.graceSeconds``)."""
    return max(SERVE_GRACEFUL_S, cfg.server.drain_grace_s + DRAIN_MOVE_S)


def build_app(args: dict[str, Any]) -> Application:
    cfg = PrismConfig.model_validate(args.get("config", {}))
    key = cfg.observability.media_hash_key or secrets.token_hex(16)  # one key for every replica of this app
    retry = cfg.server.retry_after_s
    pipelines: list[list[Application | None]] = []  # per served model, in the config's order
    held: list[StageConfig] = []  # the groups the ingress replicas hold (deployments.in_ingress)
    for sub in cfg.served():
        raw = sub.model_dump(mode="json")
        raw["observability"]["media_hash_key"] = key
        suffix = deployment_suffix(sub.model.name) if cfg.models else ""  # one model: plain names, as before
        d = sub.deployments
        if d.in_ingress:  # (its one group is built in each ingress replica: services.ingress.local_handles)
            pipelines.append([])
            held.append(d.group_stage(groups(d.topology)[0]))
            continue
        media = None  # (grouped with encode: the group holds it)
        if media_apart(d.topology):
            media = serve.deployment(**_options(f"Media{suffix}", d.media, retry))(MediaDeployment).bind(raw)
        groups_ = [_stage_app(g, sub, suffix, retry, raw) for g in groups(d.topology)]
        pipelines.append([media, *groups_])
    raw = cfg.model_dump(mode="json")
    raw["observability"]["media_hash_key"] = key
    front = _options("Ingress", cfg.deployments.ingress, retry)
    front["graceful_shutdown_timeout_s"] = _stopping_s(cfg)
    actor = front["ray_actor_options"]
    for stage in held:  # (the replica runs their threads and loads their models: it asks what their replicas would)
        actor["num_cpus"] += stage.num_cpus
        actor["num_gpus"] += stage.num_gpus  # (each model its own share of the device, as in a replica of its own)
        for name, amount in stage.resources.items():
            actor["resources"][name] = actor["resources"].get(name, 0) + amount
    ingress = serve.deployment(**front)(IngressApp)
    return ingress.bind(raw, pipelines)
