"""The batch job's output directory: an append-only log of part files, and one results file per run.

Layout::

    <output>/_parts/part-<ns>-<id>.parquet   one per finished batch, written to a temp name then renamed (atomic)
    <output>/results.parquet                  exactly one row per manifest row, in manifest order, rewritten at the end

The parts are the resume log: a killed job loses at most the batches that were in flight. A re-run reads them,
skips every id already ``ok`` and retries the rest (errors and never-finished rows). ``results.parquet`` takes, per
id, an ``ok`` row over an error, and the latest part over an older one. Directories starting with ``_`` are
ignored by pyarrow/Spark dataset readers, so reading ``<output>`` as a dataset sees only the results.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

STAGES = ("fetch_decode", "process", "encode", "prefill", "decode")
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("status", pa.string()),
        ("text", pa.string()),
        ("logprobs", pa.string()),
        ("choices", pa.string()),
        ("error_code", pa.string()),
        ("error_message", pa.string()),
        ("frames", pa.int64()),
        ("visual_tokens", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        *[(f"seconds_{s}", pa.float64()) for s in STAGES],
    ]
)
RESULTS = "results.parquet"


def empty_row(row_id: str) -> dict[str, Any]:
    return {f.name: None for f in SCHEMA} | {"id": row_id}


class OutputDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.parts = self.path / "_parts"
        self.parts.mkdir(parents=True, exist_ok=True)

    def write_part(self, rows: Sequence[dict[str, Any]]) -> Path | None:
        """Append one batch of result rows (atomically: a part is either whole or absent)."""
        if not rows:
            return None
        table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in SCHEMA} for r in rows], schema=SCHEMA)
        name = f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"
        tmp = self.parts / f".{name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, self.parts / name)
        return self.parts / name

    def _part_rows(self) -> Iterable[dict[str, Any]]:
        for part in sorted(self.parts.glob("part-*.parquet")):  # names sort in write order
            yield from pq.read_table(part, schema=SCHEMA).to_pylist()

    def latest(self) -> dict[str, dict[str, Any]]:
        """Per id, the row that counts: ``ok`` beats an error, a later part beats an earlier one."""
        best: dict[str, dict[str, Any]] = {}
        for row in self._part_rows():
            old = best.get(row["id"])
            if old is None or row["status"] == "ok" or old["status"] != "ok":
                best[row["id"]] = row
        return best

    def done_ids(self) -> set[str]:
        return {i for i, row in self.latest().items() if row["status"] == "ok"}

    def finalize(self, ids: Sequence[str]) -> Path:
        """Write ``results.parquet``: one row per manifest id, in manifest order (a row that never finished — the
        job was stopped — appears as an error ``not_processed``)."""
        latest = self.latest()
        rows = []
        for row_id in ids:
            row = latest.get(row_id)
            if row is None:
                row = empty_row(row_id) | {
                    "status": "error",
                    "error_code": "not_processed",
                    "error_message": "the job ended before this row was processed",
                }
            rows.append(row)
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        tmp = self.path / f".{RESULTS}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, self.path / RESULTS)
        return self.path / RESULTS
