r"""Conversion between a transformers ``DynamicCache`` and :class:`KVBlocks` (numpy, fixed block size).

Prefill exports its cache as blocks so decode — possibly in another process — can import it. The hand-off layout
is ``[layers, blocks, kv_heads, block_size, head_dim]`` (head-major, as transformers' caches hold it); the paged pool
stores blocks token-major and converts once per request (:meth:`common.kv.pool.KVPool.store_blocks`). Import
validates the blocks against the receiving model's geometry and refuses anything inconsistent with
:class:`HandoffError` (a corrupt or foreign hand-off must never reach attention). The prefill stage :func:`seal`\ s
its output before publishing it — the attempt's key and a CRC-32 of the KV bytes — and the decode stage
:func:`verify_handoff`\ s what it fetched: a payload of another request or attempt (stale), or whose bytes changed on
the way with its shape intact (a bad copy, a buffer reused before the READ), is refused rather than decoded into a
plausible answer.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import DynamicCache

from common.errors import HandoffError
from common.protocol.handoff import KVBlocks, PrefillOutput

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


def export_kv(cache: DynamicCache, block_size: int) -> KVBlocks:
    """Cut a batch-1 cache into blocks; the tail of the last block is zero."""
    keys = torch.stack([layer.keys[0] for layer in cache.layers])  # [L, H, T, D]
    values = torch.stack([layer.values[0] for layer in cache.layers])
    dtype = str(keys.dtype).removeprefix("torch.")
    if dtype not in _TORCH_DTYPES:
        raise HandoffError(f"cannot export KV of dtype {dtype}")
    n_layers, n_heads, n_tokens, head_dim = keys.shape
    n_blocks = -(-n_tokens // block_size)
    pad = n_blocks * block_size - n_tokens

    def blocks(x: torch.Tensor) -> np.ndarray:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        x = x.view(n_layers, n_heads, n_blocks, block_size, head_dim).permute(0, 2, 1, 3, 4)
        return to_numpy(x, dtype)

    return KVBlocks(block_size=block_size, num_tokens=n_tokens, dtype=dtype, keys=blocks(keys), values=blocks(values))


def validate_kv(kv: KVBlocks, kv_shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """Refuse blocks that do not fit a model with ``kv_shape`` = (layers, kv_heads, head_dim) and ``dtype``."""
    n_layers, n_heads, head_dim = kv_shape
    want_dtype = str(dtype).removeprefix("torch.")
    if kv.dtype != want_dtype:
        raise HandoffError(f"KV dtype {kv.dtype} does not match the model's {want_dtype}")
    if kv.block_size <= 0 or kv.num_tokens <= 0:
        raise HandoffError("KV hand-off has no tokens")
    shape = (n_layers, -(-kv.num_tokens // kv.block_size), n_heads, kv.block_size, head_dim)
    for name, arr in (("keys", kv.keys), ("values", kv.values)):
        if tuple(arr.shape) != shape:
            raise HandoffError(f"KV {name} shape {tuple(arr.shape)} != expected {shape}")
        if arr.dtype != _WIRE_NUMPY[kv.dtype]:
            raise HandoffError(f"KV {name} numpy dtype {arr.dtype} does not encode {kv.dtype}")


def kv_checksum(kv: KVBlocks) -> int:
    """CRC-32 of the blocks' bytes, keys then values (~1.5 GB/s here: a few ms for a few MB of KV)."""
    crc = zlib.crc32(memoryview(np.ascontiguousarray(kv.keys)).cast("B"))
    return zlib.crc32(memoryview(np.ascontiguousarray(kv.values)).cast("B"), crc)


def seal(out: PrefillOutput, request_key: str) -> PrefillOutput:
    """``out`` bound to the attempt it was computed for, with the checksum of its KV."""
    return dataclasses.replace(out, request_key=request_key, checksum=kv_checksum(out.kv))


def verify_handoff(pre: PrefillOutput, request_key: str) -> None:
    """Refuse a sealed hand-off of another request or attempt, or one whose KV bytes are not the ones sealed."""
    if pre.request_key and pre.request_key != request_key:
        raise HandoffError(f"stale KV hand-off: it was computed for {pre.request_key!r}, not {request_key!r}")
    if pre.checksum >= 0 and kv_checksum(pre.kv) != pre.checksum:
        raise HandoffError("KV hand-off corrupted: its bytes do not match the checksum prefill sealed it with")


def check_prefill(lm: LoadedModel, pre: PrefillOutput) -> None:
    """Refuse a prefill hand-off from another model, or whose KV does not match its prompt or the model's geometry."""
    if pre.model_revision != lm.contract.model_revision:
        raise HandoffError(f"KV from model revision {pre.model_revision}, this is {lm.contract.model_revision}")
    if pre.kv.num_tokens != len(pre.prompt_token_ids):
        raise HandoffError(f"KV holds {pre.kv.num_tokens} tokens but the prompt has {len(pre.prompt_token_ids)}")
    validate_kv(pre.kv, lm.kv_shape, lm.dtype)


def import_kv(kv: KVBlocks, config, kv_shape: tuple[int, int, int], dtype: torch.dtype) -> DynamicCache:
    """Validated blocks → a batch-1 ``DynamicCache`` holding exactly ``num_tokens`` positions."""
    validate_kv(kv, kv_shape, dtype)
    n_layers, n_heads, head_dim = kv_shape

    def tokens(arr: np.ndarray) -> torch.Tensor:
        t = to_torch(arr, kv.dtype).permute(0, 2, 1, 3, 4).reshape(n_layers, n_heads, -1, head_dim)
        return t[:, :, : kv.num_tokens].contiguous()

    keys, values = tokens(kv.keys), tokens(kv.values)
    cache = DynamicCache(config=config)
    for i in range(n_layers):
        cache.update(keys[i][None], values[i][None], i)
    return cache
