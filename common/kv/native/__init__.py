"""The CPU decode-attention kernel (``paged_decode_attention.c``): built on first use, loaded through ctypes.

Why a kernel of our own: on the CPU, a batched decode step's attention through PyTorch is one
``scaled_dot_product_attention`` call per sequence and layer (sequences attend over different block runs of the
pool, and PyTorch has no paged or varlen attention on the CPU): at batch 32 that is 256 calls a step, each costing
more in dispatch and scratch allocation than in reading its KV (profiled: 37 % of a batch-32 step, the KV read at
≈ 3–4 GB/s). The kernel reads every sequence's KV once, through its block table, where it lies in the pool, and
runs the whole batch of one layer in one call on ``torch.get_num_threads()`` threads of PyTorch's own OpenMP pool,
without the GIL. :meth:`DecodeKernel.rope_attend` does the layer's whole attention from its fused q|k|v projection in
the same call: each sequence's new query and key heads rotated (transformers' rotary embedding, bit for bit) and its
new key and value rows written into its pool slot, by the thread that then attends it.

Lifecycle: :func:`load_decode_kernel` builds the C source on first use — once per machine, cached, for the CPU it
runs on (:mod:`common.native_build`, which says how and why it links as it does) — and loads it. Without a
compiler, with ``PRISM_NATIVE_ATTENTION=0``, or if no cache folder can take the library, it returns ``None`` and the
engine keeps PyTorch's per-sequence path (logged once) — the same tokens in fp32 up to float rounding, slower. The
kernel takes fp32 and bf16 (bf16 widened to fp32 and summed in fp32, rounded where PyTorch's CPU attention rounds:
each exp, and the output once — ``paged_decode_attention.c``); other dtypes, non-CPU pools and shapes it does not
take (query heads not a multiple of KV heads, …) use the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from common.native_build import address, load_optional

log = logging.getLogger("prism.kv.native")

SOURCE = Path(__file__).with_name("paged_decode_attention.c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def torch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` arithmetic on one tensor (``[B, heads, 1, dim]``; cos/sin ``[B, 1, 1,
    dim]``), op for op: what :meth:`DecodeKernel.rope_attend`'s rotation must equal bit for bit."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


class DecodeKernel:
    """``attend(query, keys, values, tables, lengths, scale)`` for one layer of one decode step."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.fast_path = bool(library.paged_decode_attention_fast_path())
        """Whether this build has the AVX-512 loops (head sizes 64 and 128, 1 to 8 query heads per KV head)."""
        self._fns = {torch.float32: library.paged_decode_attention, torch.bfloat16: library.paged_decode_attention_bf16}
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_float]
            fn.argtypes += [ctypes.c_int]
        self.rope_exact = True
        """Whether :meth:`rope_attend`'s rotation gave PyTorch's bits when checked (:func:`load_decode_kernel`); if
        not, it returns ``None`` and the caller rotates with PyTorch's ops."""
        self._rope_fns = {
            torch.float32: library.paged_decode_rope_attention,
            torch.bfloat16: library.paged_decode_rope_attention_bf16,
        }
        for fn in self._rope_fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [_PTR] * 7 + [_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int]

    def rope_address(self, dtype: torch.dtype) -> int:
        """:meth:`rope_attend`'s C entry point's address for ``dtype`` (:mod:`common.engine.decode_layers` calls it
        from C)."""
        return address(self._rope_fns[dtype])

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor | None:
        """``query`` ``[B, q_heads, 1, dim]``; ``keys``/``values`` one layer of the pool ``[blocks, block_size,
        kv_heads, dim]``; ``tables`` ``[B, width]`` int64 block ids; ``lengths`` ``[B]`` int64 tokens each sequence
        attends over. Returns ``[B, q_heads, 1, dim]``, or ``None`` when the kernel does not take these inputs
        (dtype, layout, head counts) or could not run (no scratch memory) — the caller then takes its own path."""
        batch, q_heads, _, dim = query.shape
        _, block_size, kv_heads, kv_dim = keys.shape
        if not (
            query.dtype == keys.dtype == values.dtype
            and query.dtype in self._fns
            and tables.dtype == lengths.dtype == torch.int64
            and keys.shape == values.shape
            and kv_dim == dim
            and kv_heads >= 1
            and q_heads % kv_heads == 0
            and keys.is_contiguous()
            and values.is_contiguous()
            and tables.is_contiguous()
            and lengths.is_contiguous()
            and tables.shape[0] == lengths.shape[0] == batch
        ):
            return None
        query = query.contiguous()
        out = torch.empty_like(query)
        pointers = (query.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr())
        status = self._fns[query.dtype](*pointers, *_step(tables, lengths, q_heads, kv_heads, dim, block_size, scale))
        return out if status == 0 else None

    def rope_attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
        q_heads: int,
    ) -> torch.Tensor | None:
        """One layer's whole decode-step attention from its fused projection: ``qkv`` ``[B, 1, (q_heads + 2 *
        kv_heads) * dim]`` (q, k, v heads in that order), ``cos``/``sin`` ``[B, 1, dim]`` (each sequence's new
        position), ``keys``/``values``/``tables`` as :meth:`attend`, ``lengths`` the tokens each sequence attends over
        (its new one included). Rotates the query and key heads (bit for bit transformers' ``apply_rotary_pos_emb``),
        writes the new key and value rows into the pool, attends, and returns ``[B, 1, q_heads * dim]`` — the input of
        the output projection; ``None`` when it does not take these inputs or could not run (the caller then takes its
        own path, which writes the same rows again)."""
        batch = qkv.shape[0]
        _, block_size, kv_heads, dim = keys.shape
        if (
            not self.rope_exact
            or qkv.dtype not in self._rope_fns
            or not _rope_inputs(qkv, cos, sin, keys, values, tables, lengths, q_heads)
        ):
            return None
        query = torch.empty(batch, q_heads, dim, dtype=qkv.dtype)
        out = torch.empty(batch, 1, q_heads * dim, dtype=qkv.dtype)
        inputs = (qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), query.data_ptr())
        pool = (keys.data_ptr(), values.data_ptr(), out.data_ptr())
        status = self._rope_fns[qkv.dtype](
            *inputs, *pool, *_step(tables, lengths, q_heads, kv_heads, dim, block_size, scale)
        )
        return out if status == 0 else None


def _step(tables, lengths, q_heads: int, kv_heads: int, dim: int, block_size: int, scale: float) -> tuple:
    """The arguments both C entry points end with: the block tables (and their width), the lengths, the batch, the
    head counts and size, the block size, the scale and the threads (PyTorch's)."""
    batch = lengths.shape[0]
    shape = (batch, q_heads, kv_heads, dim, block_size)
    return (tables.data_ptr(), tables.shape[1], lengths.data_ptr(), *shape, scale, torch.get_num_threads())


def _rope_inputs(qkv, cos, sin, keys, values, tables, lengths, q_heads: int) -> bool:
    """Whether :meth:`DecodeKernel.rope_attend` takes these inputs (shapes, dtypes, layouts)."""
    batch = qkv.shape[0]
    _, _, kv_heads, dim = keys.shape
    return (
        qkv.dtype == cos.dtype == sin.dtype == keys.dtype == values.dtype
        and qkv.shape == (batch, 1, (q_heads + 2 * kv_heads) * dim)
        and cos.shape == sin.shape == (batch, 1, dim)
        and tables.dtype == lengths.dtype == torch.int64
        and keys.shape == values.shape
        and kv_heads >= 1
        and q_heads % kv_heads == 0
        and dim % 2 == 0
        and all(t.is_contiguous() for t in (qkv, cos, sin, keys, values, tables, lengths))
        and tables.shape[0] == lengths.shape[0] == batch
    )


@functools.cache
def load_decode_kernel() -> DecodeKernel | None:
    """The kernel, built on first use (once per process; the build itself once per machine), or ``None``."""
    loaded = load_optional(
        SOURCE, "PRISM_NATIVE_ATTENTION", "native decode attention", "PyTorch's per-sequence path (slower)"
    )
    if loaded is None:
        return None
    kernel = DecodeKernel(*loaded)
    kernel.rope_exact = rope_agrees(kernel)
    if not kernel.rope_exact:
        log.warning(
            "the kernel's rotary embedding differs from PyTorch's here (a compiler that fuses multiply-adds?): "
            "PyTorch rotates, the kernel attends"
        )
    return kernel


def rope_agrees(kernel: DecodeKernel) -> bool:
    """Whether ``rope_attend``'s rotation and KV write give PyTorch's bits on random inputs (fp32 and bf16): checked
    once per process, as the compiler that built the kernel decides whether products and sums round one by one."""
    gen = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, dim, block_size = 3, 4, 2, 64, 16
    tables, lengths = torch.arange(batch).view(batch, 1), torch.tensor([1, 5, 16])
    for dtype in (torch.float32, torch.bfloat16):
        qkv = (4 * torch.randn(batch, 1, (q_heads + 2 * kv_heads) * dim, generator=gen)).to(dtype)
        angles = 50 * torch.rand(batch, 1, dim, generator=gen)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        keys = torch.zeros(batch, block_size, kv_heads, dim, dtype=dtype)
        if kernel.rope_attend(qkv, cos, sin, keys, keys.clone(), tables, lengths, 0.125, q_heads) is None:
            return False
        heads = qkv.view(batch, 1, q_heads + 2 * kv_heads, dim).transpose(1, 2)
        rotated = torch_rotate(heads[:, q_heads : q_heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1))
        if not torch.equal(keys[torch.arange(batch), lengths - 1], rotated[:, :, 0]):
            return False
    return True
