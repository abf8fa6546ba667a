"""``deployments:`` — replicas, resources and queue bounds of each deployment, with per-stage defaults."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from common.config.base import Strict
from common.config.topology import Group, Topology


class StageConfig(Strict):
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
    max_surge_percent: int = Field(default=100, ge=0, le=100)
    """Extra replicas Serve may start during a rolling update (``serve deploy`` of a changed config that restarts
    replicas), as a percentage of the target count, rounded up: the replacements start *before* the replicas they
    replace stop, so a stage of one replica is never without one (its old replica keeps serving until the new one
    answers, then drains: see ``server.drain_grace_s``). It needs room for the extra replicas (CPU shares, or nodes the
    cluster's autoscaler adds); until a replacement fits, the old replica goes on serving. 0: Serve's own default,
    stop before start (a stage of one replica has a gap the ingress rides out within each request's deadline)."""
    cpu_nice: int = Field(default=0, ge=0, le=19)
    """OS scheduling niceness the replica's threads are raised to (never lowered; Prism starts Ray's workers at 0,
    ``services/platform/priority.py``). Where
    stages share CPU cores (a CPU-only node; media replicas beside the LM engines' host threads), a higher value on
    the throughput stages (media, encode) gives the latency path (ingress, prefill, decode) the cores first, so a
    flood of large images cannot slow short requests through the CPU scheduler. 0 leaves the priority alone."""
    heap_keep_bytes: int = Field(default=0, ge=0)
    """Freed memory the replica's heaps keep for the next request instead of giving it back to the kernel (glibc's trim
    threshold; blocks up to 32 MiB are then served from the heaps too): a stage that allocates and frees tens of MB
    of activations per request otherwise pays their page faults on every request (``services/platform/memory.py``).
    Resident memory stays at the replica's peak heap use. 0 leaves glibc's defaults; the encode and prefill stages
    keep 256 MiB by default. Process-wide: a replica that holds several stages keeps the largest of theirs."""

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
    fetch_threads: int = Field(default=32, ge=1)
    """Threads of a replica that download media (and check headers): a pool of the stage's own, so a flood of slow
    URLs waits for these and for nothing else of the replica's."""
    decode_threads: int = Field(default=4, ge=1)
    """Threads of a replica that decode and process media (within the pixel budget)."""
    cpu_nice: int = Field(default=19, ge=0, le=19)
    """OS niceness: media decoding yields the cores to the latency path (see :class:`StageConfig`)."""


class EncodeStageConfig(StageConfig):
    max_ongoing_requests: int = Field(default=128, ge=1)
    """Requests a replica works on at once (the patch budget bounds what encodes)."""
    cpu_nice: int = Field(default=18, ge=0, le=19)
    """OS niceness: the encoder yields the cores to the latency path (see :class:`StageConfig`): a flood of large
    images is mostly media and encoder work, and this is what keeps it off the text path's cores. Past capacity it
    slows requests with images too (``docs/limits.md``, "What the priority costs")."""
    heap_keep_bytes: int = Field(default=256 << 20, ge=0)
    """The vision tower's activations stay in the heap between requests (see :class:`StageConfig`)."""


class PrefillStageConfig(StageConfig):
    max_ongoing_requests: int = Field(default=128, ge=1)
    """Requests a replica works on at once (the token budget bounds what computes)."""
    long_lane_nice: int = Field(default=0, ge=0, le=19)
    """OS niceness of the thread that prefills prompts with media or over ``admission.lane_max_prompt_tokens``
    (the low-latency lane's thread keeps the replica's own). 0 by default: a prompt with an image is latency work too
    (its TTFT is the request's), and a long lane at 18 (under ``SCHED_IDLE``) waited on the run queue behind every
    wake-up of the Ray and Serve threads that share its cores, even with a core idle — on a 2-core machine the mixed
    load's goodput at 4 rps read 2.29 rps against 3.66 at 0 (medians of three runs). The price is paid by text under
    large-image floods: its p95 over idle rose 1.28 → 1.34, another tenant's 1.42 → 1.83; that flood is mostly media
    and encoder work, which keep their priority (``docs/limits.md``, "What the priority costs")."""
    heap_keep_bytes: int = Field(default=256 << 20, ge=0)
    """The forward pass's activations stay in the heap between requests (see :class:`StageConfig`)."""


class DecodeStageConfig(StageConfig):
    max_ongoing_requests: int = Field(default=64, ge=1)
    """Sequences a replica streams at once."""


def deployment_suffix(served_name: str) -> str:
    """A served model's name as the suffix of its deployments' names (letters, digits, ``_`` and ``-`` only)."""
    return "-" + re.sub(r"[^A-Za-z0-9_-]", "_", served_name)


class ModelStages(Strict):
    """The four stages that serve one model, and how they group into deployments."""

    topology: Topology = "E/P/D"
    """Which stages share a deployment (:mod:`common.config.topology`): ``E/P/D`` (each apart), ``E/PD``, ``EP/D`` or
    ``EPD``, with the media stage apart; ``ME/P/D``, ``ME/PD`` or ``MEPD`` with it in the encoder's group. A grouped
    deployment is sized by its last stage's entry below, with the CPUs of its stages added up and the most GPUs any of
    them asks (:meth:`group_stage`)."""
    in_ingress: bool = False
    """With ``topology: MEPD``: the model's one group runs inside each ingress replica instead of a deployment of its
    own — the ingress calls its stages in process, so a request crosses no Serve hop after the proxy. The ingress's
    replicas are then the model's (its settings size them: its replica count, autoscaling and ``max_ongoing_requests``;
    the group's CPUs, GPUs and custom resources are added to the ingress's). The stage entries' Serve settings
    (replicas, autoscaling, queue bounds, ``max_ongoing_requests``) then size nothing; everything else in them still
    does — every stage keeps its own budgets, threads and niceness. A decode stream cannot migrate (the replica that
    holds it is the one the client's connection goes through)."""
    media: MediaStageConfig = MediaStageConfig()
    encode: EncodeStageConfig = EncodeStageConfig()
    prefill: PrefillStageConfig = PrefillStageConfig()
    decode: DecodeStageConfig = DecodeStageConfig()

    @model_validator(mode="after")
    def _in_ingress_holds_every_stage(self) -> ModelStages:
        if self.in_ingress and self.topology != "MEPD":
            raise ValueError(
                "deployments.in_ingress needs topology MEPD (every stage of the model in one group), "
                f"not {self.topology}"
            )
        return self

    @field_validator("topology", mode="before")
    @classmethod
    def _no_media_before_reservation(cls, value: object) -> object:
        if isinstance(value, str) and value.replace(" ", "") == "MEP/D":
            raise ValueError(
                "topology MEP/D is not offered: the ingress reserves the decode KV before its one call to that group, "
                "so a slow download would hold decode blocks; use EP/D (media apart) or ME/P/D"
            )
        return value

    def group_stage(self, group: Group) -> StageConfig:
        """The deployment settings of ``group``: its last stage's, with every grouped stage's CPUs (each has threads of
        its own) and the most GPUs one of them asks (they share the device: one process, one CUDA context). A group
        that holds media also has media's ``max_ongoing_requests`` on top of its last stage's: each request's call
        holds a slot of the group from its first download byte, so downloads (slow or hostile ones too) use media's
        slots rather than those of the requests whose media is done."""
        stages = [getattr(self, s) for s in group]
        last = stages[-1]
        ongoing = last.max_ongoing_requests + (self.media.max_ongoing_requests if "media" in group else 0)
        return last.model_copy(
            update={
                "num_cpus": sum(s.num_cpus for s in stages),
                "num_gpus": max(s.num_gpus for s in stages),
                "max_ongoing_requests": ongoing,
            }
        )


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
