"""The batch job's Ray Data pipeline: thin adapters between Ray Data batches and :mod:`common.batch.work`.

Lives in its own module (not the ``python -m services.batch`` entry point) so Ray workers import these functions
and classes by name instead of unpickling them from the driver's ``__main__``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from common.batch.work import ClipEncoder, ClipGenerator, ClipLoader, input_row
from common.config import PrismConfig


@functools.lru_cache(maxsize=2)
def _loader(config_json: str) -> ClipLoader:
    """One loader per worker process (tasks reuse processes), not one per row."""
    return ClipLoader(PrismConfig.model_validate_json(config_json))


def _load(row: dict[str, Any], config_json: str) -> dict[str, Any]:
    return _loader(config_json)(row)


def _rows(batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    n = len(next(iter(batch.values())))
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def _columns(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    out = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if isinstance(values[0], (np.ndarray, str)):
            # Ragged tensors become an Arrow tensor column; strings stay Python objects, because a numpy "<U" array
            # would cut a generated text at its first NUL character.
            column = np.empty(len(values), dtype=object)
            column[:] = values
            out[key] = column
        else:
            out[key] = np.asarray(values)
    return out


_WORK = {"encode": ClipEncoder, "generate": ClipGenerator}


class _Actor:
    """One actor of a pool: holds its stage's model for the job's life and maps row batches through it."""

    def __init__(self, config_json: str, stage: str) -> None:
        self.work = _WORK[stage](PrismConfig.model_validate_json(config_json))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _columns(self.work(_rows(batch)))


def build_dataset(rows: list[dict[str, Any]], cfg: PrismConfig):
    import ray.data

    b = cfg.batch
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the job logs its own progress lines (rows, rate, ETA)
    config_json = cfg.model_dump_json()
    ds = ray.data.from_items([input_row(r) for r in rows])
    ds = ds.map(
        _load,
        fn_kwargs={"config_json": config_json},
        num_cpus=b.media_num_cpus,
        compute=ray.data.TaskPoolStrategy(size=b.media_concurrency),
    )
    for stage, size, actors, gpus in (
        ("encode", b.encode_batch_size, b.encode_actors, b.encode_num_gpus),
        ("generate", b.generate_batch_size, b.generate_actors, b.generate_num_gpus),
    ):
        ds = ds.map_batches(
            _Actor,
            fn_constructor_kwargs={"config_json": config_json, "stage": stage},
            batch_size=size,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=b.actor_num_cpus,
            num_gpus=gpus,
        )
    return ds
