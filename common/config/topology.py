"""How a model's stages group into Serve deployments: ``deployments.topology``.

A topology names the groups of the model-side stages in request order, ``/`` between deployments: ``E/P/D`` (encode,
prefill and decode each in deployments of their own: the default), ``E/PD`` (encoder apart, prefill and decode in one
replica), ``EP/D`` (encoder and prefill together, decode apart) and ``EPD`` (all three in one replica). By
default the media stage (fetch, decode, processor) is a deployment of its own: it is where a hostile download or a
large image waits. An ``M`` before the ``E`` puts it in the encoder's group instead — ``ME/P/D``, ``ME/PD``, ``MEPD``
(every stage of the model in one replica) — which saves a request with media one Serve hop and one process, at the
price of downloads and image decoding running beside the encoder (and, in ``MEPD``, beside the LM engines: the
stages' niceness still gives the cores to the latency path). Either way a request's KV is reserved only once its media
is done (:mod:`services.ingress.chain`): a slow or hostile download holds no decode blocks. That is why there is no
``MEP/D``: there the ingress reserves the KV before its one call to the media-encode-prefill group, so a download would
wait holding them.

Stages in one group hand off in process (no serialisation, no object store; the KV crosses with one copy, from the
prefill's export into the decode pool's blocks); between groups they go through the model's transport as before. A
group is one deployment (one router, one ``max_ongoing_requests``), so it is sized by :func:`group_stage`: the entry
of the stage that ends it — its replicas, autoscaling range and target, queue bounds and custom resources (the group
runs where that stage would) — with the CPUs of every stage it holds added up and the most GPUs one of them asks
(the stages share the replica's device).

Lifecycle: read from the config at build time (:mod:`services.app` makes one deployment per group) and by the ingress
(:class:`services.ingress.chain.Chain` calls each group once per request, :func:`hops`).
"""

from __future__ import annotations

from typing import Literal

Topology = Literal["E/P/D", "E/PD", "EP/D", "EPD", "ME/P/D", "ME/PD", "MEPD"]
Stage = Literal["media", "encode", "prefill", "decode"]
Group = tuple[Stage, ...]

_LETTER: dict[str, Stage] = {"M": "media", "E": "encode", "P": "prefill", "D": "decode"}
MEDIA_WORK: frozenset[str] = frozenset({"media", "encode"})
"""The stages only a request with media runs (a text-only request skips them)."""


def groups(topology: Topology) -> tuple[Group, ...]:
    """The topology's groups, in request order: ``E/PD`` → ``(("encode",), ("prefill", "decode"))``; ``ME/P/D`` →
    ``(("media", "encode"), ("prefill",), ("decode",))``. A media stage of its own is not among them (see
    :func:`media_apart`)."""
    return tuple(tuple(_LETTER[c] for c in part) for part in topology.split("/"))


def media_apart(topology: Topology) -> bool:
    """Whether the media stage is a deployment of its own (no ``M`` in the topology), called before the groups."""
    return "M" not in topology


def group_name(group: Group) -> str:
    """A group's deployment name (before the model suffix): ``Encode``, ``PrefillDecode``, ``MediaEncode``, …"""
    return "".join(stage.capitalize() for stage in group)


def deployment_names(topology: Topology) -> list[str]:
    """A model's deployments in request order, before the model suffix: ``Media`` when it is apart, then one per
    group."""
    return ["Media"] * media_apart(topology) + [group_name(g) for g in groups(topology)]


def group_of(topology: Topology, stage: Stage) -> Group:
    """The group that holds ``stage`` (``ValueError`` for media where it is a deployment of its own)."""
    for group in groups(topology):
        if stage in group:
            return group
    raise ValueError(f"topology {topology}: no group holds {stage} (media apart is the Media deployment)")


def hops(topology: Topology, with_media: bool) -> list[Group]:
    """The calls one request makes after a media stage of its own (or from the first, when media is grouped), each a
    group cut to the stages the request runs (a text-only request skips media and encode): ``EPD`` →
    ``[("encode", "prefill", "decode")]``, or ``[("prefill", "decode")]`` for text."""
    out = [tuple(s for s in g if with_media or s not in MEDIA_WORK) for g in groups(topology)]
    return [g for g in out if g]
