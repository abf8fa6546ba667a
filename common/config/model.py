"""``model:`` — which model to serve and how to load it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from common.config.base import Strict


class ModelConfig(Strict):
    """Which model to serve and how to load it."""

    model: str = "prism-tiny-llava"
    """An embedded model name (``prism-tiny-llava``, ``prism-tiny-qwen2vl``, ``prism-small-*``) or a local HF
    checkpoint directory of a supported family."""
    served_name: str | None = None
    """Name clients use in the ``model`` field; defaults to ``model`` (or the directory's name)."""
    cache_dir: str = "~/.cache/prism/models"
    """Where embedded models are built on first use."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights/activation dtype; ``auto`` takes the checkpoint's own dtype."""
    torch_threads: int | None = Field(default=None, ge=1)
    """torch intra-op threads for this process; set it to the replica's CPU share so replicas don't fight."""
    cpu_linear: Literal["onednn", "torch"] = "onednn"
    """How the model's linear layers compute on the CPU: ``onednn`` packs each fp32/bf16 weight once at load into
    oneDNN's blocked layout and computes through it (about 2× PyTorch's fp32 path on a batch-32 decode step's GEMMs
    here; every such weight is then held twice), a call of at most 32 fp32 rows through Prism's row kernel where the
    CPU has AVX-512 (a third copy of those weights: :mod:`common.model.linear`); ``torch``: PyTorch's own
    ``F.linear``."""
    transport: Literal["object_store", "nixl"] | None = None
    """How this model's visual embeddings (encode → prefill) and KV (prefill → decode) move; ``None``: the
    application's ``server.transport``. Each model of a several-model application may choose its own."""

    @property
    def name(self) -> str:
        """The name clients use (what :func:`common.model.loader.load_frontend` serves it as)."""
        if self.served_name:
            return self.served_name
        path = Path(self.model).expanduser()
        return path.resolve().name if path.is_dir() else self.model
