"""A batched decode step's forward pass through the language model, without transformers' module stack.

Why: a batch-32 decode step of ``prism-small-llava`` computes its weight GEMMs in about 9 ms and attends in about 4,
yet took about 19 ms through the model's ``forward``: the rest was the stack around the arithmetic — about a
thousand module calls per step, each through ``nn.Module.__call__`` and transformers' decorators (kwarg deprecation,
output capture), a mask built and ignored, per-projection GEMMs. For one new token per sequence the decoder is a
short fixed sequence of tensor ops, and this module runs exactly that sequence.

Exactness: every op is the one transformers runs, on the same operands in the same order (RMSNorm in fp32 then back,
rotary embedding as ``(x * cos) + (rotate_half(x) * sin)`` with the model's own ``rotary_emb``, the residual adds,
``act(gate) * up``), so the hidden states are bit for bit the model's — tested against the model's forward for both
families, in fp32 and bf16. Three things are fused, all bit-identical (tested): with packed linears
(:mod:`common.model.linear`) each layer's q, k and v projections are one GEMM on their concatenated weights, and so are
its gate and up projections (neither oneDNN's packed product of a column nor the row kernel's depends on the other
columns); the rotary embedding rotates the query and key heads in one pass over the fused output; and with the native
attention kernel, that rotation, the new key and value rows' write into the pool and the attention are one call on the
fused output (:meth:`common.kv.native.DecodeKernel.rope_attend`, the rotation rounded op by op as PyTorch rounds it).
Each residual add and the RMSNorm after it (the next layer's input norm, the final norm after the last) are one call as
well where :mod:`common.kv.native.norm` agrees with PyTorch bit for bit here. The two replaced about forty PyTorch ops a
layer: a batch-32 step of ``prism-small-llava`` 22.8 → 20.8 ms, a batch-1 step 6.7 → 5.5 ms (fp32, 2 threads, the same
engine alternating both paths, 2026-12-05). In fp32 on the row kernel, the gate|up GEMM ends in the MLP's activation
(:class:`GatedUp`: each tile stores ``silu(gate) * up``, PyTorch's expression with the exp PyTorch itself calls), which
drops the split, the silu and the multiply: the 8 layers' gate|up and activation 4.63 → 4.17 ms a batch-32 step,
1.64 → 1.43 at batch 1 (2-core AMD EPYC, both paths alternating in one process, 2026-12-06). Where every layer runs on
those kernels, a step of at most 32 rows calls them all from C in one call (:mod:`common.engine.decode_layers`: the
same kernels, the same bits, none of the Python between them).

Lifecycle: :meth:`DecodeForward.build` runs once per model object, when its first decode engine starts
(:meth:`DecodeForward.shared`: kept on the language model module, so it lives and dies with the model); it checks the
fusion and the gated product bit for bit on the first layer's weights (else the projections stay separate, or the
activation PyTorch's) and returns ``None`` for a
language model whose layers are not a known Llama-style decoder (LLaVA's Llama, Qwen2-VL's text model) or that uses
sliding-window attention, and the engine keeps the model's own forward. It loads the norm kernel for the model's
hidden size (built once per machine, checked against PyTorch once per process). The fused weights are packed copies made
then (q, k, v, gate and up once more: 67 MB for ``prism-small-llava`` in fp32; with the gated GEMM, gate and up are
held once more as its panels instead, 46 MB, and no fused gate|up is kept) and read-only afterwards, as the model's
weights are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLDecoderLayer

from common.engine.decode_layers import DecodeLayers
from common.kv.native import torch_rotate as rotate
from common.kv.native.norm import NormKernel, load_norm_kernel, torch_add_norm
from common.kv.paged_attention import PagedContext, paged_attention_forward
from common.model.linear import BATCH_HINT, PackedLinear, PackedWeight
from common.model.row_gemm import MAX_ROWS, RowGemm, interleave, load_row_gemm

DECODER_LAYERS = (LlamaDecoderLayer, Qwen2VLDecoderLayer)
"""Decoder layer classes whose forward this module reproduces: pre-norm RMSNorm, q/k/v projections (with or
without bias), rotary embedding from the model's ``rotary_emb``, attention, o projection, gated MLP."""


class Fused:
    """One GEMM over several projections' concatenated weights (and biases), packed as a linear's
    (:class:`common.model.linear.PackedWeight`)."""

    def __init__(self, layers: list[torch.nn.Linear]):
        weight = torch.cat([m.weight.detach() for m in layers])
        biases = [m.bias for m in layers]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.packed = PackedWeight(weight)
        self.sizes = [m.out_features for m in layers]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.product(x, self.bias)


class GatedUp:
    """A gated MLP's gate|up GEMM ending in its activation: ``silu(gate) * up`` out of one row-kernel call
    (:meth:`common.model.row_gemm.RowGemm.silu_mul`), for calls of at most :data:`MAX_ROWS` fp32 rows; ``None`` for
    any other (the caller then takes the fused GEMM and PyTorch's activation)."""

    def __init__(self, kernel: RowGemm, gate: torch.nn.Linear, up: torch.nn.Linear):
        self.kernel, self.n = kernel, gate.out_features
        self.panels = kernel.pack_gated(gate.weight, up.weight)
        self.bias = None if gate.bias is None else interleave(gate.bias.detach(), up.bias.detach())

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        batch, _, hidden = x.shape
        if x.dtype != torch.float32 or batch > MAX_ROWS:
            return None
        out = self.kernel.silu_mul(x.reshape(batch, hidden).contiguous(), self.panels, self.n, self.bias)
        return None if out is None else out.view(batch, 1, self.n)

    @staticmethod
    def of(layer: Any) -> GatedUp | None:
        """The layer's gated GEMM where this machine can compute it (the row kernel runs, with SLEEF's exp) and the
        layer is an fp32 SiLU MLP whose width is a multiple of 32, else ``None``. It runs SLEEF's exp on every element,
        as PyTorch's silu does on one row of such a width (a sequence decoded alone, as by ``generate()``); PyTorch's
        silu over many rows on many threads may run glibc's exp on the last elements of a thread's share where the
        share does not end on 32 elements (not on 2 threads at this model's 1408), so there the gated bits are the
        single row's. :func:`_gating_is_exact` checks them against PyTorch's on the first layer."""
        mlp, kernel = layer.mlp, load_row_gemm()
        gate, up = mlp.gate_proj, mlp.up_proj
        if kernel is None or kernel.sleef_exp is None or gate.weight.dtype != torch.float32 or gate.out_features % 32:
            return None
        if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation") or (gate.bias is None) != (up.bias is None):
            return None
        return GatedUp(kernel, gate, up)


def _attention(layer: Any) -> list[torch.nn.Linear]:
    attn = layer.self_attn
    return [attn.q_proj, attn.k_proj, attn.v_proj]


def _mlp(layer: Any) -> list[torch.nn.Linear]:
    return [layer.mlp.gate_proj, layer.mlp.up_proj]


def _fusion_is_exact(layer: Any) -> bool:
    """Fused and separate projections agree bit for bit on this layer's own weights, at 1 and 32 rows, on this
    machine and thread count (oneDNN's blocking is the same whatever the columns here, and the row kernel sums each
    column alone; were it not so on another CPU, the step would keep the separate GEMMs rather than round differently
    from the model)."""
    with torch.inference_mode():
        for projections in (_attention(layer), _mlp(layer)):
            fused = Fused(projections)
            for rows in (1, BATCH_HINT):
                x = torch.randn(rows, projections[0].in_features, generator=torch.Generator().manual_seed(rows))
                x = x.to(projections[0].weight.dtype)
                if not torch.equal(fused(x), torch.cat([m(x) for m in projections], dim=-1)):
                    return False
    return True


def _gating_is_exact(layer: Any) -> bool:
    """The gated GEMM gives what the fused GEMM and the model's activation give, bit for bit, on this layer's weights
    at 1, 5 and 32 rows (the fused product as the row kernel computes it, from a packed copy let go after)."""
    gated, mlp = GatedUp.of(layer), layer.mlp
    if gated is None:
        return False
    n, projections = gated.n, _mlp(layer)
    panels = gated.kernel.pack(torch.cat([m.weight.detach() for m in projections]))
    bias = None if projections[0].bias is None else torch.cat([m.bias.detach() for m in projections])
    with torch.inference_mode():
        for rows in (1, 5, MAX_ROWS):
            x = torch.randn(rows, projections[0].in_features, generator=torch.Generator().manual_seed(rows))
            both, got = gated.kernel.product(x, panels, 2 * n, bias), gated(x.view(rows, 1, -1))
            if both is None or got is None or not torch.equal(got.view(rows, n), mlp.act_fn(both[:, :n]) * both[:, n:]):
                return False
    return True


@dataclass
class _Layer:
    module: Any
    qkv: Fused | None
    gate_up: Fused | None
    gated: GatedUp | None = None


class DecodeForward:
    """The decode step of one language model: ``input_ids`` ``[B, 1]`` and ``position_ids`` (the family's
    ``decode_positions``) with a :class:`PagedContext` → the final-normed hidden states ``[B, 1, hidden]``, exactly
    what ``language_model(..., prism_paged=ctx).last_hidden_state`` returns."""

    def __init__(self, lang: Any, fuse: bool, gate: bool = False, head: Any = None):
        self.lang = lang
        self.layers = [self._lean(layer, fuse, gate) for layer in lang.layers]
        attn = lang.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.norms: NormKernel | None = load_norm_kernel(lang.config.hidden_size)
        """The residual adds and norms in one call each (:mod:`common.kv.native.norm`), or PyTorch's ops."""
        config = lang.config
        self.q_heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.chain: DecodeLayers | None = DecodeLayers.of(self, head) if fuse and gate else None
        """Every layer's kernels in one foreign call, the embedding and the LM head's GEMM with them
        (:mod:`common.engine.decode_layers`), where they all run."""

    @staticmethod
    def _lean(layer: Any, fuse: bool, gate: bool) -> _Layer:
        """One layer's fused and gated GEMMs. A gated layer keeps no fused gate|up (a call the gated GEMM does not take,
        over 32 rows, goes to the separate projections: their oneDNN products are the fused one's, and the model's)."""
        gated = GatedUp.of(layer) if gate else None
        return _Layer(
            layer,
            Fused(_attention(layer)) if fuse else None,
            Fused(_mlp(layer)) if fuse and gated is None else None,
            gated,
        )

    @classmethod
    def shared(cls, lang: Any, head: Any = None) -> DecodeForward | None:
        """:meth:`build`'s result for ``lang`` (and its model's LM head), built once per model object: every engine on
        one model shares its fused weights (tests and benchmarks start many engines on one model)."""
        # (kept on the module itself: a cache keyed by the module would hold it alive through its value)
        if "_prism_decode_forward" not in vars(lang):
            vars(lang)["_prism_decode_forward"] = cls.build(lang, head)
        return vars(lang)["_prism_decode_forward"]

    @classmethod
    def build(cls, lang: Any, head: Any = None) -> DecodeForward | None:
        """The lean forward for ``lang``, or ``None`` where it would not be the model's own (see the module
        docstring). Fused GEMMs where every projection is a packed linear; ``head``: the model's LM head, whose GEMM
        the one-call path (:attr:`chain`) runs too where it can."""
        layers = getattr(lang, "layers", None)
        if not layers or any(type(layer) not in DECODER_LAYERS for layer in layers):
            return None
        if not all(hasattr(lang, name) for name in ("embed_tokens", "norm", "rotary_emb")):
            return None
        if getattr(lang.config, "use_sliding_window", False):
            return None
        projections = [m for layer in layers for m in (*_attention(layer), *_mlp(layer))]
        fuse = all(isinstance(m, PackedLinear) for m in projections) and _fusion_is_exact(layers[0])
        return cls(lang, fuse=fuse, gate=fuse and _gating_is_exact(layers[0]), head=head)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: PagedContext) -> torch.Tensor:
        return self._forward(input_ids, position_ids, ctx, None)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: PagedContext, head: Any) -> torch.Tensor:
        """``head`` (the model's LM head) on the final hidden states: the step's logits ``[B, vocab]``."""
        return self._forward(input_ids, position_ids, ctx, head)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: PagedContext, head: Any) -> Any:
        """The hidden states, or with ``head`` the logits: in one foreign call where :attr:`chain` takes the step."""
        lang = self.lang
        if position_ids.ndim == 3 and position_ids.shape[0] == 4:  # (Qwen2-VL's text row first, as its forward drops)
            position_ids = position_ids[1:]
        # ([B, 1, dim] each; the rotary embedding reads only its input's dtype and device: the embeddings' are the
        # table's)
        cos, sin = lang.rotary_emb(lang.embed_tokens.weight, position_ids)
        out = self.chain(input_ids, cos, sin, ctx) if self.chain is not None else None
        hidden, logits = out if out is not None else (self._layers_in_python(input_ids, cos, sin, ctx), None)
        if head is None:
            return hidden
        if logits is not None and self.chain is not None and head is self.chain.head:
            return logits
        return head(hidden[:, -1:, :])[:, -1]

    def _layers_in_python(self, input_ids: torch.Tensor, cos, sin, ctx: PagedContext) -> torch.Tensor:
        """The final-normed hidden states, each layer's kernels (or PyTorch's ops) called from here."""
        h = self.lang.embed_tokens(input_ids)
        # Each residual add goes with the norm after it: the next layer's input norm, after the last layer the
        # model's final norm.
        h, x = self._add_norm(h, None, self.layers[0].module.input_layernorm)
        for i, layer in enumerate(self.layers):
            after = self.layers[i + 1].module.input_layernorm if i + 1 < len(self.layers) else self.lang.norm
            h, x = self._layer(layer, h, x, cos, sin, ctx, after)
        return x

    def _layer(self, layer: _Layer, h, x, cos, sin, ctx: PagedContext, after: torch.nn.Module) -> tuple[Any, Any]:
        """One decoder layer from its input ``h`` and ``x`` (``h`` normed by its input norm): the residual stream
        after it and that normed by ``after``."""
        attn, mlp = layer.module.self_attn, layer.module.mlp
        h, x = self._add_norm(
            h, attn.o_proj(self._attention(layer, x, cos, sin, ctx)), layer.module.post_attention_layernorm
        )
        act = layer.gated(x) if layer.gated is not None else None
        if act is None:
            if layer.gate_up is not None:
                gate, up = layer.gate_up(x).split(layer.gate_up.sizes, dim=-1)
            else:
                gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            act = mlp.act_fn(gate) * up
        return self._add_norm(h, mlp.down_proj(act), after)

    def _add_norm(self, h: torch.Tensor, add: torch.Tensor | None, norm: torch.nn.Module) -> tuple[Any, Any]:
        """``(h + add, norm(h + add))`` (``h`` as it is without ``add``)."""
        add_norm = self.norms.add_norm if self.norms is not None else torch_add_norm
        return add_norm(h, add, norm.weight, norm.variance_epsilon)

    def _attention(self, layer: _Layer, x: torch.Tensor, cos, sin, ctx: PagedContext) -> torch.Tensor:
        """The attention's output ``[B, 1, q_heads * dim]`` (the o projection's input), this step's KV written. With
        fused projections and the native kernel, one call after the GEMM does the rotation, the KV write and the
        attention (:meth:`DecodeKernel.rope_attend`: PyTorch's ops between them cost more than the arithmetic)."""
        attn = layer.module.self_attn
        batch, dim, q_heads, kv_heads = x.shape[0], self.head_dim, self.q_heads, self.kv_heads
        if layer.qkv is not None:
            fused = layer.qkv(x)
            if ctx.kernel is not None:
                pool, index = ctx.pool, attn.layer_idx
                out = ctx.kernel.rope_attend(
                    fused,
                    cos,
                    sin,
                    pool.keys[index],
                    pool.values[index],
                    ctx.block_tables,
                    ctx.attend_lengths,
                    self.scaling,
                    q_heads,
                )
                if out is not None:
                    return out
            heads = fused.view(batch, 1, q_heads + 2 * kv_heads, dim).transpose(1, 2)
            rotated = rotate(heads[:, : q_heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1))  # (q and k at once)
            q, k, v = rotated[:, :q_heads], rotated[:, q_heads:], heads[:, q_heads + kv_heads :]
        else:
            q = attn.q_proj(x).view(batch, 1, -1, dim).transpose(1, 2)
            k = attn.k_proj(x).view(batch, 1, -1, dim).transpose(1, 2)
            v = attn.v_proj(x).view(batch, 1, -1, dim).transpose(1, 2)
            q, k = rotate(q, cos.unsqueeze(1), sin.unsqueeze(1)), rotate(k, cos.unsqueeze(1), sin.unsqueeze(1))
        out, _ = paged_attention_forward(attn, q, k, v, None, scaling=self.scaling, prism_paged=ctx)
        return out.reshape(batch, 1, -1)
