"""A decode step's decoder layers in one foreign call (``decode_layers.c``): the lean forward's kernels, back to back
in C.

Why: :class:`common.engine.decode_forward.DecodeForward` runs each layer as seven kernels — the fused q|k|v GEMM, the
rotation + KV write + attention, the o projection, the residual add + norm, the gated gate|up GEMM, the down
projection, the add + norm — called from Python, each with its checks, its output tensor and its ctypes crossing:
about 1.8 ms of a batch-32 step of ``prism-small-llava`` was Python between kernels, a step's whole arithmetic being
about 15 ms, and the other OpenMP thread spun meanwhile. Here one call runs every layer's seven kernels, each the
same entry point of its own library with the same inputs and threads: the hidden states are the Python path's bit for
bit (tested), as the Python path's are the model's. The step's two ends run in the same call: the token embeddings
(rows of the table, copied, as ``F.embedding`` copies them) with the first layer's input norm, and the LM head's GEMM
(the row kernel, as the head's own call takes it) — in Python, after the memory traffic of the layers had evicted the
interpreter's working set, those few ops took about 0.6 ms of a batch-32 step.

Lifecycle: :meth:`DecodeLayers.of` runs once per lean forward (:meth:`DecodeForward.build`): where every layer takes
the fast kernels (fused q|k|v and gated gate|up on the row kernel, the o and down projections' panels, the native
norm, the attention kernel with its exact rotation) it builds and loads the C driver (once per machine, cached:
:mod:`common.native_build`; ``PRISM_NATIVE_LAYERS=0`` turns it off) and records each layer's weights' addresses
(the panels, made then, and the norm weights — read-only, and held by the driver as long as it lives). Each
step (:meth:`DecodeLayers.__call__`) takes the batch of at most :data:`~common.model.row_gemm.MAX_ROWS` rows on the
engine's pool and kernel, allocates one scratch buffer for the step's intermediates, and returns the final-normed
hidden states and the logits — or ``None`` for a step it does not take or a kernel that refused or failed, a token id
outside the embedding table among them (then the caller runs the step its own way, which writes the same KV rows
again, or raises as PyTorch does).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.kv.native import DecodeKernel, load_decode_kernel
from common.kv.paged_attention import PagedContext
from common.model.linear import PackedLinear
from common.model.row_gemm import MAX_ROWS, RowGemm, load_row_gemm
from common.native_build import load_optional

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_layers.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class LayerWeights(ctypes.Structure):
    """``layer_t``: one layer's panels, biases (or ``None``), norm weights and epsilons, and its pool layer."""

    _fields_ = [
        *((name, _P) for name in ("qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias")),
        *((name, _P) for name in ("down", "down_bias", "next_norm")),
        ("index", _I64),
        ("post_eps", ctypes.c_float),
        ("next_eps", ctypes.c_float),
    ]


_SIZES = ("rows", "hidden", "inter", "q_heads", "kv_heads", "dim", "block_size", "table_width", "lanes")
_SCRATCH = ("h", "x", "qkv", "query", "attn", "proj", "act", "logits")
KERNELS = ("qkv", "attention", "o_proj", "attention_norm", "gate_up", "down", "mlp_norm")
"""A layer's kernels in the order they run (``decode_layers.c``'s enum)."""


class Chain(ctypes.Structure):
    """``chain_t``: the kernels' addresses, the sizes, one step's inputs and scratch buffers."""

    _fields_ = [
        *((name, _P) for name in ("gemm", "gated", "sleef_exp", "rope", "norm")),
        *((name, _I64) for name in _SIZES),
        ("scale", ctypes.c_float),
        ("threads", ctypes.c_int),
        *((name, _P) for name in ("cos", "sin", "tables", "lengths", "keys", "values")),
        ("layer_size", _I64),
        *((name, _P) for name in _SCRATCH[:-1]),
        ("ns", ctypes.POINTER(_I64)),
        ("embedding", _P),
        ("first_norm", _P),
        ("ids", _P),
        ("table_rows", _I64),
        ("first_eps", ctypes.c_float),
        ("head", _P),
        ("head_bias", _P),
        ("vocab", _I64),
        ("logits", _P),
    ]


class DecodeLayers:
    """``layers(ids, cos, sin, ctx)`` → the final-normed hidden states ``[B, 1, hidden]`` of the tokens ``ids``
    (``[B, 1]``) and, with a head, its logits ``[B, vocab]`` (else ``None``); or ``None`` for the step."""

    def __init__(self, library: ctypes.CDLL, forward: Any, attention: DecodeKernel, head: Any) -> None:
        self._fn = library.decode_layers
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(Chain), ctypes.POINTER(LayerWeights), _I64]
        self.attention = attention
        gemm, norms, lang = load_row_gemm(), forward.norms, forward.lang
        assert gemm is not None and gemm.sleef_exp is not None and norms is not None
        self.hidden, self.inter = lang.config.hidden_size, forward.layers[0].gated.n
        self.q_heads, self.kv_heads, self.dim = forward.q_heads, forward.kv_heads, forward.head_dim
        self.head = head if _head_takes(head, self.hidden) else None
        """The LM head whose GEMM ends each step here (a packed fp32 linear), or ``None``: the caller's."""
        self._ns = (_I64 * len(KERNELS))()  # (added to by every step, in C)
        self._pinned = _Pinned()
        """The tensors whose memory C reads (every step, for the driver's life)."""
        self._layers = _weights(forward, gemm, self._pinned.address)
        self._pool_layers = 1 + max(layer.index for layer in self._layers)
        """The pool layers a step writes: a pool of fewer is refused (the Python path raises there)."""
        embedding, first = lang.embed_tokens.weight, forward.layers[0].module.input_layernorm
        head_panels = self.head.packed.row_panels(gemm) if self.head is not None else None
        pin = self._pinned.address
        template = dict(
            gemm=gemm.address,
            gated=gemm.gated_address,
            sleef_exp=gemm.sleef_exp,
            rope=attention.rope_address(torch.float32),
            norm=norms.address(torch.float32),
            hidden=self.hidden,
            inter=self.inter,
            q_heads=self.q_heads,
            kv_heads=self.kv_heads,
            dim=self.dim,
            lanes=norms.lanes,
            scale=forward.scaling,
            embedding=pin(embedding),
            table_rows=embedding.shape[0],
            first_norm=pin(first.weight),
            first_eps=first.variance_epsilon,
            head=pin(head_panels),
            head_bias=None if self.head is None else pin(self.head.bias),
            vocab=0 if self.head is None else self.head.out_features,
            ns=self._ns,
        )
        self._base = Chain(**template)
        """The fields every step shares; a step's copy gets its own inputs and buffers."""
        sizes = [self.hidden, self.hidden, (self.q_heads + 2 * self.kv_heads) * self.dim]
        sizes += [self.q_heads * self.dim, self.q_heads * self.dim, self.hidden, self.inter, template["vocab"]]
        self._offsets = dict(zip(_SCRATCH, itertools.accumulate([0, *sizes[:-1]]), strict=True))
        """Each scratch buffer's place in a step's one allocation, per row."""
        self._row_floats = sum(sizes)

    @staticmethod
    def of(forward: Any, head: Any = None) -> DecodeLayers | None:
        """The driver for ``forward``'s layers (and ``head``, the model's LM head, where it is a packed fp32 linear)
        where each takes the fast kernels (see the module docstring), else ``None`` (the lean forward then calls the
        kernels from Python)."""
        gemm, attention = load_row_gemm(), load_decode_kernel()
        if gemm is None or gemm.sleef_exp is None or forward.norms is None or attention is None:
            return None
        if not attention.rope_exact or not _embedding_takes(forward.lang.embed_tokens):
            return None
        layers, norm = forward.layers, forward.lang.norm.weight
        if layers[0].gated is None or not all(_takes(layer, layers[0].gated.n) for layer in layers):
            return None
        if norm.dtype != torch.float32 or not norm.is_contiguous():
            return None
        loaded = load_optional(SOURCE, "PRISM_NATIVE_LAYERS", "native decoder layers", "the kernels called from Python")
        return None if loaded is None else DecodeLayers(loaded[0], forward, attention, head)

    def __call__(
        self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: PagedContext
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        batch = ids.shape[0]
        pool, tables, lengths = ctx.pool, ctx.block_tables, ctx.attend_lengths
        if batch > MAX_ROWS or ctx.kernel is not self.attention or tables is None or lengths is None:
            return None
        if not self._step_inputs(ids, cos, sin, pool.keys, pool.values, tables, lengths):
            return None
        # (few Python ops here: they run right after the previous step's memory traffic, on a cold interpreter)
        scratch = torch.empty(batch * self._row_floats, dtype=torch.float32)
        base, chain = scratch.data_ptr(), Chain.from_buffer_copy(self._base)
        for name, offset in self._offsets.items():
            setattr(chain, name, base + 4 * batch * offset)
        chain.rows, chain.block_size, chain.table_width = batch, pool.block_size, tables.shape[1]
        chain.threads, chain.layer_size = torch.get_num_threads(), pool.keys.numel() // pool.keys.shape[0]
        chain.cos, chain.sin, chain.tables, chain.lengths = (t.data_ptr() for t in (cos, sin, tables, lengths))
        chain.ids, chain.keys, chain.values = ids.data_ptr(), pool.keys.data_ptr(), pool.values.data_ptr()
        failed = self._fn(ctypes.byref(chain), self._layers, len(self._layers))
        if failed:
            log.warning("native decoder layers: %s refused the step; it runs from Python", _refused(failed))
            return None
        x, at = self._offsets["x"] * batch, self._offsets["logits"] * batch
        logits = scratch[at:].view(batch, -1) if self.head is not None else None
        return scratch[x : x + batch * self.hidden].view(batch, 1, self.hidden), logits

    @property
    def seconds(self) -> dict[str, float]:
        """Spent in each kernel of a layer, summed over the layers of this driver's steps (a benchmark's split of a
        step; the attention's includes the rotation and the KV write)."""
        return {name: ns / 1e9 for name, ns in zip(KERNELS, self._ns, strict=True)}

    def _step_inputs(self, ids, cos, sin, keys, values, tables, lengths) -> bool:
        """Whether the step's inputs are what the kernels read: fp32 (ids, tables, lengths int64), contiguous, of the
        model's sizes."""
        batch = ids.shape[0]
        return (
            ids.shape == (batch, 1)
            and cos.shape == sin.shape == (batch, 1, self.dim)
            and keys.shape == values.shape
            and keys.dim() == 5
            and keys.shape[0] >= self._pool_layers
            and keys.shape[-2:] == (self.kv_heads, self.dim)
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (cos, sin, keys, values))
            and ids.dtype == tables.dtype == lengths.dtype == torch.int64
            and all(t.is_contiguous() for t in (ids, tables, lengths))
            and tables.shape[0] == lengths.shape[0] == batch
        )


def _refused(code: int) -> str:
    """What ``decode_layers`` returned ``code`` for (its refusal codes)."""
    if code == -1:
        return "the embedding (a token id outside the table) or the first norm"
    if code == -2:
        return "the LM head"
    layer, kernel = divmod(code - 1, len(KERNELS))
    return f"layer {layer}'s {KERNELS[kernel]} kernel"


class _Pinned(list):
    """Tensors whose memory C code reads, held for as long as it may (this list's life)."""

    def address(self, t: torch.Tensor | None) -> int | None:
        """``t``'s data address (``None`` for none), ``t``'s storage held: a module repacked or a parameter given new
        data later cannot free what C reads."""
        if t is None:
            return None
        self.append(t.detach())
        return t.data_ptr()


def _weights(forward: Any, gemm: RowGemm, ptr: Callable[[torch.Tensor | None], int | None]) -> ctypes.Array:
    """Each layer's ``layer_t``: its panels (made now where not yet), biases, norm weights (their addresses from
    ``ptr``, which holds them) and pool layer."""
    lang, weights = forward.lang, []
    for i, layer in enumerate(forward.layers):
        module, mlp = layer.module, layer.module.mlp
        after = forward.layers[i + 1].module.input_layernorm if i + 1 < len(forward.layers) else lang.norm
        o, down, norm = module.self_attn.o_proj, mlp.down_proj, module.post_attention_layernorm
        weights.append(
            LayerWeights(
                qkv=ptr(layer.qkv.packed.row_panels(gemm)),
                qkv_bias=ptr(layer.qkv.bias),
                o=ptr(o.packed.row_panels(gemm)),
                o_bias=ptr(o.bias),
                post_norm=ptr(norm.weight),
                gate_up=ptr(layer.gated.panels),
                gate_up_bias=ptr(layer.gated.bias),
                down=ptr(down.packed.row_panels(gemm)),
                down_bias=ptr(down.bias),
                next_norm=ptr(after.weight),
                index=module.self_attn.layer_idx,
                post_eps=norm.variance_epsilon,
                next_eps=after.variance_epsilon,
            )
        )
    return (LayerWeights * len(weights))(*weights)


def _takes(layer: Any, inter: int) -> bool:
    """Whether a lean layer runs on the fast kernels only — fused q|k|v and gated gate|up (``inter`` wide, as every
    layer's: one scratch buffer serves them all), the o and down projections packed fp32 linears (their panels the row
    kernel's) — with fp32 contiguous biases and norm weights, as the kernels' Python callers check on each call."""
    module = layer.module
    linears = (module.self_attn.o_proj, module.mlp.down_proj)
    if layer.qkv is None or layer.gated is None or layer.gated.n != inter or not layer.qkv.packed.rows:
        return False
    vectors = [layer.qkv.bias, layer.gated.bias, *(m.bias for m in linears)]
    vectors += [module.input_layernorm.weight, module.post_attention_layernorm.weight]
    return all(isinstance(m, PackedLinear) and m.packed.rows for m in linears) and all(
        t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in vectors
    )


def _embedding_takes(embedding: Any) -> bool:
    """Whether the token embedding is a plain fp32 table the driver copies rows of (no renormalisation)."""
    weight = getattr(embedding, "weight", None)
    return (
        type(embedding) is torch.nn.Embedding
        and embedding.max_norm is None
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.is_contiguous()
    )


def _head_takes(head: Any, hidden: int) -> bool:
    """Whether an LM head's GEMM runs in the driver: a packed fp32 linear of the hidden size with the row kernel's
    panels."""
    return isinstance(head, PackedLinear) and head.packed.rows and head.in_features == hidden
