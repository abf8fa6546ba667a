r"""Conversion between a transformers ``DynamicCache`` and :class:`KVBlocks` (numpy, fixed block size).

Prefill exports its cache as blocks so decode — possibly in another process — can import it. The hand-off layout
is the decode pool's own, ``[layers, blocks, block_size, kv_heads, head_dim]`` (token-major inside a block:
:mod:`common.kv.pool`), so a hand-off lands in the pool's blocks by plain copies of contiguous runs — or by one
transfer straight into them (:mod:`common.kv.transport`) — with no transpose after it; the one permutation (from
transformers' head-major cache) happens once, in :func:`export_kv`, which writes into buffers the caller chooses (a
staging slot registered with a transport, or fresh arrays). Import validates the blocks against the receiving model's
geometry and refuses anything inconsistent with :class:`HandoffError` (a corrupt or foreign hand-off must never reach
attention). The prefill stage :func:`seal`\ s its output before publishing it — the attempt's key and the checksum
of the KV bytes (segmented XXH3-64, :mod:`common.kv.digest`) — and the decode stage checks what landed in its pool
against it: a payload of another request or attempt (stale), or whose bytes changed on the way with its shape intact
(a bad copy, a buffer reused before the read), is refused rather than decoded into a plausible answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import DynamicCache

from common.errors import HandoffError, RevisionMismatch
from common.kv.digest import SCHEME, SegmentedDigest, digest, flat_bytes
from common.protocol.handoff import KVBlocks, KVLayout, Prefilled, PrefillOutput

if TYPE_CHECKING:
    from common.model.loader import LoadedModel

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# numpy has no bfloat16: those tensors travel as their raw 16-bit patterns.
_WIRE_NUMPY = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}


def to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return t.contiguous().view(torch.uint16).numpy()
    return t.contiguous().numpy()


def to_torch(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


Buffers = Callable[[tuple[int, ...], np.dtype], tuple[np.ndarray, np.ndarray]]
"""Where an export writes: ``(shape, numpy dtype) -> (keys, values)``, two C-contiguous arrays of that shape."""


def fresh_buffers(shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    return np.empty(shape, dtype), np.empty(shape, dtype)


def kv_geometry(n_layers: int, n_tokens: int, block_size: int, n_heads: int, head_dim: int) -> tuple[int, ...]:
    """The hand-off shape of ``n_tokens`` tokens: ``[layers, blocks, block_size, kv_heads, head_dim]``."""
    return (n_layers, -(-n_tokens // block_size), block_size, n_heads, head_dim)


def export_kv(cache: DynamicCache, block_size: int, buffers: Buffers = fresh_buffers) -> KVBlocks:
    """Cut a batch-1 cache into blocks in the pool's layout, written into ``buffers``; the tail of the last block is
    zero."""
    return _export(cache, block_size, buffers, None)


def export_sealed_kv(cache: DynamicCache, block_size: int, buffers: Buffers = fresh_buffers) -> tuple[KVBlocks, int]:
    """:func:`export_kv` and the checksum of what it wrote (:func:`kv_checksum`'s value), each layer hashed right
    after it is written, while its bytes are still in cache: the seal costs a pass over cached bytes, not a second
    trip through the whole KV."""
    h = SegmentedDigest()
    kv = _export(cache, block_size, buffers, h)
    return kv, h.intdigest()


def _export(cache: DynamicCache, block_size: int, buffers: Buffers, h: SegmentedDigest | None) -> KVBlocks:
    dtype = str(cache.layers[0].keys.dtype).removeprefix("torch.")
    if dtype not in _TORCH_DTYPES:
        raise HandoffError(f"cannot export KV of dtype {dtype}")
    _, n_heads, n_tokens, head_dim = cache.layers[0].keys.shape
    shape = kv_geometry(len(cache.layers), n_tokens, block_size, n_heads, head_dim)
    keys, values = buffers(shape, np.dtype(_WIRE_NUMPY[dtype]))
    for name, out in (("keys", keys), ("values", values)):  # (keys first, then values: the digest's byte order)
        dst = to_torch(out, dtype).view(shape[0], shape[1] * block_size, n_heads, head_dim)
        for i, layer in enumerate(cache.layers):  # a layer at a time: [H, T, D] -> [T, H, D], one copy
            dst[i, :n_tokens].copy_(getattr(layer, name)[0].transpose(0, 1))
            dst[i, n_tokens:].zero_()
            if h is not None:
                h.update(flat_bytes(out[i]))
    return KVBlocks(block_size=block_size, num_tokens=n_tokens, dtype=dtype, keys=keys, values=values)


def validate_kv(kv: KVBlocks, kv_shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """Refuse blocks that do not fit a model with ``kv_shape`` = (layers, kv_heads, head_dim) and ``dtype``."""
    if kv.values.shape != kv.keys.shape or kv.values.dtype != kv.keys.dtype:
        raise HandoffError(f"KV values {kv.values.shape} {kv.values.dtype} do not match the keys")
    check_layout(kv.layout, kv_shape, dtype)


def check_layout(layout: KVLayout, kv_shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """Refuse a hand-off whose KV (held here, or described by a remote sender) does not fit its own token count and a
    model with ``kv_shape`` = (layers, kv_heads, head_dim) and ``dtype``."""
    n_layers, n_heads, head_dim = kv_shape
    want_dtype = str(dtype).removeprefix("torch.")
    if layout.dtype != want_dtype:
        raise HandoffError(f"KV dtype {layout.dtype} does not match the model's {want_dtype}")
    if layout.block_size <= 0 or layout.num_tokens <= 0:
        raise HandoffError("KV hand-off has no tokens")
    want = kv_geometry(n_layers, layout.num_tokens, layout.block_size, n_heads, head_dim)
    if tuple(layout.shape) != want:
        raise HandoffError(f"KV shape {tuple(layout.shape)} != expected {want}")
    if np.dtype(layout.numpy_dtype) != _WIRE_NUMPY[layout.dtype]:
        raise HandoffError(f"KV numpy dtype {layout.numpy_dtype} does not encode {layout.dtype}")


def kv_checksum(kv: KVBlocks) -> int:
    """The hand-off checksum of the blocks' bytes, keys then values (:mod:`common.kv.digest`: faster than a copy)."""
    return digest((np.ascontiguousarray(kv.keys), np.ascontiguousarray(kv.values)))


def seal(out: PrefillOutput, request_key: str) -> PrefillOutput:
    """``out`` bound to the attempt it was computed for, with the checksum of its KV (computed now unless the export
    already did: :func:`export_sealed_kv`)."""
    if out.checksum >= 0:
        return dataclasses.replace(out, request_key=request_key)
    return dataclasses.replace(out, request_key=request_key, checksum=kv_checksum(out.kv), checksum_scheme=SCHEME)


def verify_handoff(pre: PrefillOutput, request_key: str) -> None:
    """Refuse a sealed hand-off of another request or attempt, or one whose KV bytes are not the ones sealed."""
    check_key(pre, request_key)
    check_landed(pre, kv_checksum(pre.kv) if pre.checksum >= 0 else -1)


def check_prefill(lm: LoadedModel, pre: Prefilled) -> None:
    """Refuse a prefill hand-off from another model, or whose KV does not match its prompt or the model's geometry
    (on its layout: before any block is leased or any byte moves)."""
    if pre.model_revision != lm.contract.model_revision:
        raise RevisionMismatch(f"KV from model revision {pre.model_revision}, this is {lm.contract.model_revision}")
    layout = pre.layout
    if layout.num_tokens != len(pre.prompt_token_ids):
        raise HandoffError(f"KV holds {layout.num_tokens} tokens but the prompt has {len(pre.prompt_token_ids)}")
    check_layout(layout, lm.kv_shape, lm.dtype)
    if isinstance(pre, PrefillOutput):
        validate_kv(pre.kv, lm.kv_shape, lm.dtype)


def check_key(pre: Prefilled, request_key: str) -> None:
    """Refuse a sealed hand-off of another request or attempt (stale)."""
    if pre.request_key and pre.request_key != request_key:
        raise HandoffError(f"stale KV hand-off: it was computed for {pre.request_key!r}, not {request_key!r}")


def check_landed(pre: Prefilled, landed_digest: int) -> None:
    """Refuse a sealed hand-off whose bytes, where they landed, are not the ones prefill sealed."""
    if pre.checksum >= 0 and pre.checksum_scheme != SCHEME:
        raise RevisionMismatch(f"KV hand-off checksummed as {pre.checksum_scheme!r}, this replica checks {SCHEME!r}")
    if pre.checksum >= 0 and landed_digest != pre.checksum:
        raise HandoffError("KV hand-off corrupted: its bytes do not match the checksum prefill sealed it with")


def import_kv(kv: KVBlocks, config, kv_shape: tuple[int, int, int], dtype: torch.dtype) -> DynamicCache:
    """Validated blocks → a batch-1 ``DynamicCache`` holding exactly ``num_tokens`` positions."""
    validate_kv(kv, kv_shape, dtype)
    n_layers, n_heads, head_dim = kv_shape

    def tokens(arr: np.ndarray) -> torch.Tensor:
        t = to_torch(arr, kv.dtype).reshape(n_layers, -1, n_heads, head_dim).transpose(1, 2)
        return t[:, :, : kv.num_tokens].contiguous()

    keys, values = tokens(kv.keys), tokens(kv.values)
    cache = DynamicCache(config=config)
    for i in range(n_layers):
        cache.update(keys[i][None], values[i][None], i)
    return cache
