"""The batch job's input: a Parquet or JSONL manifest, one row per clip, checked before any work starts.

Columns: ``id`` (unique, non-empty string), ``video`` (a path under the media root, a ``file://`` URL under it, or an
``http(s)`` URL fetched by the same SSRF-safe fetcher as online serving), ``prompt``; optional ``max_tokens``, ``fps``,
``max_frames`` (null: the server's policy), ``response_format`` (OpenAI's, as its JSON text — or, in JSONL, the
object itself: the row's answer is constrained by it; one that cannot be served is that row's
``invalid_response_format`` error), ``logprobs`` (0–20: the answer comes with each token's log-probability and that
many alternatives, as the online API's ``top_logprobs``; null: none), ``n`` (choices of the one prompt, 1 up to the
server's ``max_n``: one prefill, their decodes sharing its KV), ``temperature`` (0–2, default 0: greedy) and ``seed``
(choice ``i`` samples with ``seed + i``; null: a random one). A malformed manifest (missing column, duplicate
or empty id, wrong type) fails the whole job at once with the row number; a bad *video* is a per-row error later,
never a job failure.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pyarrow.parquet as pq

from common.protocol.sampling import MAX_CHOICES, MAX_TOP_LOGPROBS  # (``n``: the server's max_n, lower, is a row error)

REQUIRED = ("id", "video", "prompt")
OPTIONAL = ("max_tokens", "fps", "max_frames", "response_format", "logprobs", "n", "temperature", "seed")


class ManifestError(ValueError):
    """The manifest itself is unusable (the job refuses to start)."""


@dataclass(frozen=True)
class BatchRow:
    id: str
    video: str
    """The URL the media stage fetches (plain paths already turned into ``file://`` URLs)."""
    prompt: str
    max_tokens: int | None = None
    fps: float | None = None
    max_frames: int | None = None
    response_format: str | None = None
    """JSON text of the row's ``response_format`` (``None``: free text)."""
    logprobs: int | None = None
    """Alternatives per token to report with its log-probability (``None``: no log-probabilities)."""
    n: int | None = None
    temperature: float | None = None
    seed: int | None = None


def read_manifest(path: str | Path, media_root: str | Path | None = None) -> list[BatchRow]:
    path = Path(path)
    parquet = path.suffix.lower() in (".parquet", ".pq")
    if parquet:
        records = pq.read_table(path).to_pylist()
    elif path.suffix.lower() in (".jsonl", ".ndjson", ".json"):
        records = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except ValueError as exc:
                    raise ManifestError(f"{path}:{n}: not JSON ({exc})") from None
    else:
        raise ManifestError(f"{path}: the manifest must be .parquet or .jsonl")
    root = Path(media_root) if media_root is not None else path.parent
    rows, seen = [], set()
    for n, record in enumerate(records, 1):
        row = _row(record, n, root, parquet)
        if row.id in seen:
            raise ManifestError(f"row {n}: duplicate id {row.id!r}")
        seen.add(row.id)
        rows.append(row)
    return rows


def _row(record: object, n: int, root: Path, parquet: bool = False) -> BatchRow:
    if not isinstance(record, dict):
        raise ManifestError(f"row {n}: not an object")
    missing = [c for c in REQUIRED if record.get(c) in (None, "")]
    if missing:
        raise ManifestError(f"row {n}: missing {', '.join(missing)}")
    unknown = set(record) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        raise ManifestError(f"row {n}: unknown columns {', '.join(sorted(unknown))}")
    for c in REQUIRED:
        if not isinstance(record[c], str):
            raise ManifestError(f"row {n}: {c} must be a string")
    return BatchRow(
        id=record["id"],
        video=_url(record["video"], root),
        prompt=record["prompt"],
        max_tokens=_optional(record, "max_tokens", int, n),
        fps=_optional(record, "fps", float, n),
        max_frames=_optional(record, "max_frames", int, n),
        response_format=_json_object(record, "response_format", n, parquet),
        logprobs=_bounded(record, "logprobs", n, 0, MAX_TOP_LOGPROBS),
        n=_bounded(record, "n", n, 1, MAX_CHOICES),
        temperature=_bounded(record, "temperature", n, 0.0, 2.0),
        seed=_bounded(record, "seed", n, 0, 2**63 - 1),
    )


def _bounded(record: dict, key: str, n: int, low: float, high: float) -> int | float | None:
    """An optional number from ``low`` to ``high`` — an integer when the bounds are integers (null: ``None``)."""
    value = record.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    integer = isinstance(low, int)
    kind = "an integer" if integer else "a number"
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (integer and value != int(value)):
        raise ManifestError(f"row {n}: {key} must be {kind} from {low} to {high}")
    if not low <= value <= high:
        raise ManifestError(f"row {n}: {key} is {value}; it must be from {low} to {high}")
    return int(value) if integer else float(value)


def _json_object(record: dict, key: str, n: int, parquet: bool) -> str | None:
    value = record.get(key)
    if value is None or value == "":
        return None
    if parquet and not isinstance(value, str):
        # (a struct column gives every row every key of every other row, the missing ones as null: not the object
        # that was written)
        raise ManifestError(f"row {n}: in Parquet, {key} must be a string column of JSON text")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ManifestError(f"row {n}: {key} is not JSON") from None
    if not isinstance(value, dict):
        raise ManifestError(f"row {n}: {key} must be a JSON object")
    return json.dumps(value)


def _optional(record: dict, key: str, kind: type, n: int):
    value = record.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ManifestError(f"row {n}: {key} must be a positive number")
    if kind is int and value != int(value):
        raise ManifestError(f"row {n}: {key} must be an integer")
    return kind(value)


def _url(video: str, root: Path) -> str:
    if "://" in video or video.startswith("data:"):
        return video
    path = Path(video) if Path(video).is_absolute() else root / video
    return "file://" + quote(str(path.resolve()))
