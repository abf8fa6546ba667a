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


class _Encode:
    def __init__(self, config_json: str) -> None:
        self.work = ClipEncoder(PrismConfig.model_validate_json(config_json))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _columns(self.work(_rows(batch)))


class _Generate:
    def __init__(self, config_json: str) -> None:
        self.work = ClipGenerator(PrismConfig.model_validate_json(config_json))

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
    ds = ds.map_batches(
        _Encode,
        fn_constructor_kwargs={"config_json": config_json},
        batch_size=b.encode_batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=b.encode_actors),
        num_cpus=b.actor_num_cpus,
        num_gpus=b.encode_num_gpus,
    )
    return ds.map_batches(
        _Generate,
        fn_constructor_kwargs={"config_json": config_json},
        batch_size=b.generate_batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=b.generate_actors),
        num_cpus=b.actor_num_cpus,
        num_gpus=b.generate_num_gpus,
    )
