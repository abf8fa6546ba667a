"""Typed hand-off objects passed between the stages of one request, and the context every stage call carries.

A request flows process → encode → merge → prefill → decode → ingress; each arrow is one of these objects. Every
stage call also takes the request's :class:`RequestContext` (id, attempt, tenant, deadline, priority, when the chain
was issued), and the decode stage answers with a stream of :data:`DecodeEvent` — one :class:`StreamStart`, then
:class:`StreamToken` until one carries a finish reason, or a :class:`StreamAbort`. They hold only
numpy arrays and plain Python scalars/tuples, never torch tensors or model objects, so they can cross a process
boundary (Ray object store, NIXL, or :mod:`common.protocol.wire` bytes) without dragging torch or pickled code with
them. They are frozen: a stage makes a new object rather than mutating one it received.

Layout notes that the stages rely on:

* ``ProcessedMedia.pixel_values`` is in the family's own layout (LLaVA: ``[3, H, W]``; Qwen2-VL: flattened
  patches ``[num_patches, patch_dim]``); ``grid_thw`` is the patch grid before any spatial merge.
* ``VisualEmbeddings.embeddings`` is ``[num_visual_tokens, lm_hidden]``: exactly one block per media item.
* ``KVBlocks.keys/values`` are ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` — the decode pool's
  own layout, so a hand-off lands in pool blocks with no transpose; the last block is zero-padded past
  ``num_tokens``. bfloat16 has no numpy dtype, so it travels as its raw ``uint16`` bits with ``dtype="bfloat16"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from common.errors import DeadlineExceeded
from common.obs.trace import Span
from common.protocol.vector import ResourceVector

Modality = Literal["image", "video"]
FinishReason = Literal["stop", "length"]
Priority = Literal["interactive", "batch"]


@dataclass(frozen=True)
class MediaRef:
    """One media item as the client referenced it (the ingress → the media stage)."""

    kind: Modality
    url: str
    fps: float | None = None
    max_frames: int | None = None


@dataclass(frozen=True)
class RouteKeys:
    """What the stages' routers route by (:mod:`common.sched.affinity` makes them); ``None`` where a request has no
    such key (a text-only prompt's media)."""

    media: str | None = None
    prefix: str | None = None


@dataclass(frozen=True)
class RequestContext:
    """Who a stage works for and until when. The ingress makes one per attempt of a request's chain."""

    request_id: str
    tenant: str
    deadline: float
    """Absolute wall-clock seconds (``time.time``): comparable across processes and nodes."""
    sent_at: float
    """When the ingress issued this attempt's chain; the first stage's queue span starts here."""
    attempt: int = 1
    """1 for the first chain; a chain re-issued after a lost replica counts up."""
    priority: Priority = "interactive"
    """Traffic class: every stage budget and the prefill queue rank batch work behind interactive work."""
    vector: ResourceVector | None = None
    """The request's resources as the ingress knew them (text tokens, media items, ``max_tokens``); the media stage
    completes it from the processed media."""
    route: RouteKeys | None = None
    """The cache-affinity keys the encode and prefill routers send this request by (:mod:`common.sched.affinity`)."""
    decode_replica: str | None = None
    """The decode replica that holds this attempt's KV reservation: the decode router sends its ``generate`` there
    (``None``: none taken, any replica)."""
    reservation: str = "none"
    """How the KV reservation went: ``reserved`` at once, ``waited`` for blocks, ``none`` taken (the trace's
    ``routing.decode`` outcome)."""
    replay: tuple[int, ...] = ()
    """A migration's attempt: the tokens its client already received from a lost decode replica, which the decode
    stage rebuilds the sequence through (``()``: not a migration)."""

    @property
    def batch(self) -> bool:
        return self.priority == "batch"

    @property
    def migration(self) -> bool:
        """This attempt continues a stream whose decode replica was lost (its KV reservation waits whatever the queue:
        refusing it would end a stream the client is reading)."""
        return bool(self.replay)

    @property
    def key(self) -> str:
        """The id an engine files this attempt's work under, so a re-issued chain never collides with what an earlier
        attempt may have left queued in the same replica."""
        return self.request_id if self.attempt == 1 else f"{self.request_id}#{self.attempt}"

    def remaining_s(self) -> float:
        return self.deadline - time.time()

    def check_deadline(self, stage: str) -> float:
        """Seconds left; raise 504 ``deadline_exceeded`` if none, so a stage never starts work nobody will wait for."""
        left = self.remaining_s()
        if left <= 0:
            raise DeadlineExceeded(f"deadline exceeded before the {stage} stage could start")
        return left

    def monotonic_deadline(self) -> float:
        """The deadline on this process's monotonic clock (what the engines schedule by)."""
        return time.monotonic() + self.remaining_s()


@dataclass(frozen=True)
class KVReservation:
    """A decode replica's answer to a KV reservation (:meth:`services.stages.decode.DecodeDeployment.reserve`)."""

    replica: str | None
    """The replica that holds it (``None`` outside Serve: the monolith's one decode stage)."""
    blocks: int
    waited_s: float
    """Time it waited in the pool's queue (0: granted at once)."""


@dataclass(frozen=True)
class ProcessedMedia:
    """One media item after decode and the model's processor: ready for the vision tower."""

    media_index: int
    modality: Modality
    media_digest: str
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    num_visual_tokens: int
    source_size: tuple[int, int]
    """Original (width, height) before the processor resized it."""

    @property
    def patches(self) -> int:
        """Vision patches the encoder computes for it (the patch grid before any spatial merge)."""
        t, h, w = self.grid_thw
        return t * h * w


@dataclass(frozen=True)
class VisualEmbeddings:
    """Vision tower + projector output for one media item."""

    media_index: int
    modality: Modality
    media_digest: str
    embeddings: np.ndarray
    grid_thw: tuple[int, int, int]
    encoder_revision: str

    @property
    def num_visual_tokens(self) -> int:
        return int(self.embeddings.shape[0])


class MediaSlot(Protocol):
    """What prompt building needs of a media item: :class:`ProcessedMedia` and :class:`VisualEmbeddings` both are
    one, so the prefill stage can build the prompt from embeddings without ever seeing pixels."""

    @property
    def media_index(self) -> int: ...
    @property
    def modality(self) -> Modality: ...
    @property
    def media_digest(self) -> str: ...
    @property
    def grid_thw(self) -> tuple[int, int, int]: ...
    @property
    def num_visual_tokens(self) -> int: ...


@dataclass(frozen=True)
class PlaceholderSpan:
    """Where one media item's embeddings go in the prompt: ``prompt_token_length`` placeholder tokens from
    ``prompt_token_start``; the embedding block must be ``embedding_shape`` and come from ``media_digest``."""

    media_index: int
    modality: Modality
    prompt_token_start: int
    prompt_token_length: int
    embedding_shape: tuple[int, int]
    media_digest: str
    grid_thw: tuple[int, int, int]

    @property
    def end(self) -> int:
        return self.prompt_token_start + self.prompt_token_length


@dataclass(frozen=True)
class TokenizedPrompt:
    """Prompt token ids with every placeholder expanded, and the span map that says which media fills which."""

    token_ids: np.ndarray
    spans: tuple[PlaceholderSpan, ...]


@dataclass(frozen=True)
class MergedInputs:
    """Prompt embeddings with visual embeddings scattered into their validated spans."""

    token_ids: np.ndarray
    inputs_embeds: np.ndarray
    spans: tuple[PlaceholderSpan, ...]


@dataclass(frozen=True)
class KVLayout:
    """What a hand-off's KV is, without its bytes: what a receiver checks, and leases blocks for, before any byte
    moves."""

    block_size: int
    num_tokens: int
    dtype: str
    shape: tuple[int, ...]
    """Keys' shape (values' is the same): ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``."""
    numpy_dtype: str

    @property
    def num_blocks(self) -> int:
        return int(self.shape[1])

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, keys or values."""
        return int(np.prod(self.shape[2:])) * np.dtype(self.numpy_dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Keys and values."""
        return 2 * self.shape[0] * self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class KVBlocks:
    """A sequence's KV cache cut into fixed-size blocks (see module docstring for the layout)."""

    block_size: int
    num_tokens: int
    dtype: str
    keys: np.ndarray
    values: np.ndarray

    @property
    def num_blocks(self) -> int:
        return int(self.keys.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)

    @property
    def layout(self) -> KVLayout:
        """The keys' geometry (the values must match it: :func:`common.kv.blocks.validate_kv`)."""
        return KVLayout(self.block_size, self.num_tokens, self.dtype, tuple(self.keys.shape), str(self.keys.dtype))


class Prefilled(Protocol):
    """A prefill's result as a decode replica receives it, before its KV is where decode reads it: a
    :class:`PrefillOutput` (the arrays at hand) or a transport's remote descriptor of one (the same fields, the KV
    described by its :class:`KVLayout`)."""

    @property
    def prompt_token_ids(self) -> np.ndarray: ...

    @property
    def first_token_id(self) -> int: ...

    @property
    def rope_delta(self) -> int: ...

    @property
    def model_revision(self) -> str: ...

    @property
    def request_key(self) -> str: ...

    @property
    def checksum(self) -> int: ...

    @property
    def checksum_scheme(self) -> str: ...

    @property
    def first_logprob(self) -> TokenLogprob | None: ...

    @property
    def forks(self) -> tuple[FirstToken, ...]: ...

    @property
    def layout(self) -> KVLayout: ...


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model's raw distribution at its position, and the ``top`` most
    likely tokens there as ``(token_id, logprob)``, most likely first (as many as the request asked for)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class FirstToken:
    """The first token of a request's choice ``i`` ≥ 1 (``n`` > 1): sampled by prefill from the same logits as
    choice 0's, with that choice's seed (:meth:`SamplingParams.for_choice`)."""

    token_id: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class PrefillOutput:
    """Everything decode needs to continue a sequence that prefill started, in another process if need be."""

    prompt_token_ids: np.ndarray
    first_token_id: int
    kv: KVBlocks
    rope_delta: int
    """Qwen2-VL M-RoPE: decode position = cache position + rope_delta (0 for 1-D RoPE families)."""
    model_revision: str
    request_key: str = ""
    """The attempt this was computed for (:attr:`RequestContext.key`), set when the prefill stage seals it: decode
    refuses the hand-off of another request or attempt (``""``: not sealed)."""
    checksum: int = -1
    """The checksum of the KV bytes (keys, then values) as prefill exported them (-1: not sealed): decode refuses a
    payload whose bytes, as they landed in its pool, are not these (segmented XXH3-64, :mod:`common.kv.digest`)."""
    checksum_scheme: str = ""
    """Which checksum ``checksum`` is (:data:`common.kv.digest.SCHEME` when sealed; ``""`` from code before it had
    a name): a receiver that checks another refuses the hand-off as from another revision."""
    first_logprob: TokenLogprob | None = None
    """The first token's log-probabilities (when the request asks for them): prefill sampled it, so only prefill saw
    the distribution it came from."""
    forks: tuple[FirstToken, ...] = ()
    """Choices 1 … n-1's first tokens (``n`` > 1): one prefill, one KV, ``n`` sequences in decode."""

    @property
    def layout(self) -> KVLayout:
        return self.kv.layout


@dataclass(frozen=True)
class StreamStart:
    """The first item of a decode stream: the prompt as decode received it (for usage and ``return_token_ids``) and
    the spans of every stage so far, ``decode.transfer`` included."""

    prompt_token_ids: tuple[int, ...]
    spans: tuple[Span, ...] = ()
    replica: str | None = None
    """The Serve id of the decode replica streaming (where the ingress watches for it to leave); ``None`` outside
    Serve."""
    reservation: str = "none"
    """How its KV reservation went (:attr:`RequestContext.reservation` as the decode stage got it): a group that
    reserves in its own replica tells the ingress here, as the ingress's reserver tells it in the context."""
    first: StreamToken | None = None
    """The stream's first token, when decode had it as the stream started (it has, unless the sequence waits for its
    KV lease): it comes in this item rather than the next. Each item of a Serve stream crosses from the decode
    replica to the ingress on its own, and the second one, sent while the replica's first decode step runs, took
    5.0 ms there against the first's 3.1 (p50, ``EPD``, text, 2-core AMD EPYC)."""


@dataclass(frozen=True)
class StreamToken:
    """One generated token; the last one carries its ``finish_reason`` and the KV blocks the sequence held."""

    token_id: int
    finish_reason: FinishReason | None = None
    spans: tuple[Span, ...] = ()
    """The first token carries ``decode.queue`` (KV lease wait + import + first emission)."""
    kv_blocks: int = 0
    logprob: TokenLogprob | None = None
    """Its log-probabilities, when the request asks for them (the first token's came from prefill)."""
    index: int = 0
    """The choice it belongs to (``n`` > 1: the stream interleaves the choices' tokens; each finishes on its own)."""


@dataclass(frozen=True)
class StreamAbort:
    """The sequence ended without a token: its deadline passed in the engine (``timeout``) or an engine step failed
    (``error``). Its KV is already freed."""

    reason: Literal["timeout", "error"]


DecodeEvent = StreamStart | StreamToken | StreamAbort
