"""The batch job's manifest checks, resumable output directory and progress lines (no Ray)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.batch.manifest import ManifestError, read_manifest
from common.batch.output import OutputDir, empty_row
from common.batch.progress import Progress


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_manifest_rows_and_video_urls(tmp_path):
    m = _jsonl(
        tmp_path / "m.jsonl",
        [
            {"id": "a", "video": "clips/a.mp4", "prompt": "p", "max_tokens": 5},
            {"id": "b", "video": "https://example.com/b.webm", "prompt": "p", "fps": 1.5, "max_frames": 4},
            {"id": "c", "video": "file:///data/c.mp4", "prompt": "p", "max_tokens": None},
        ],
    )
    rows = read_manifest(m)
    assert [r.id for r in rows] == ["a", "b", "c"]
    assert rows[0].video == f"file://{tmp_path}/clips/a.mp4" and rows[0].max_tokens == 5
    assert rows[1].video.startswith("https://") and rows[1].fps == 1.5 and rows[1].max_frames == 4
    assert rows[2].video == "file:///data/c.mp4" and rows[2].max_tokens is None
    table = pa.Table.from_pylist([{"id": "x", "video": "v.mp4", "prompt": "p", "max_tokens": float("nan")}])
    pq.write_table(table, tmp_path / "m.parquet")
    (row,) = read_manifest(tmp_path / "m.parquet", media_root="/media")
    assert row.video == "file:///media/v.mp4" and row.max_tokens is None


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"id": "a", "video": "v", "prompt": "p"}, {"id": "a", "video": "w", "prompt": "p"}], "row 2: duplicate id"),
        ([{"id": "", "video": "v", "prompt": "p"}], "row 1: missing id"),
        ([{"id": "a", "video": "v"}], "row 1: missing prompt"),
        ([{"id": "a", "video": "v", "prompt": "p", "colour": "red"}], "unknown columns colour"),
        ([{"id": "a", "video": "v", "prompt": "p", "max_tokens": -1}], "max_tokens must be a positive"),
        ([{"id": "a", "video": "v", "prompt": "p", "max_frames": 2.5}], "max_frames must be an integer"),
        ([{"id": 7, "video": "v", "prompt": "p"}], "id must be a string"),
        ([{"id": "a", "video": "v", "prompt": "p", "response_format": "{json"}], "response_format is not JSON"),
        ([{"id": "a", "video": "v", "prompt": "p", "response_format": [1]}], "response_format must be a JSON object"),
        ([{"id": "a", "video": "v", "prompt": "p", "logprobs": 21}], "logprobs is 21; it must be from 0 to 20"),
        ([{"id": "a", "video": "v", "prompt": "p", "logprobs": True}], "logprobs must be an integer"),
        ([{"id": "a", "video": "v", "prompt": "p", "n": 0}], "n is 0; it must be from 1 to 128"),
        ([{"id": "a", "video": "v", "prompt": "p", "n": 2.5}], "n must be an integer"),
        ([{"id": "a", "video": "v", "prompt": "p", "temperature": 2.5}], "temperature is 2.5; it must be from 0.0"),
        ([{"id": "a", "video": "v", "prompt": "p", "seed": -1}], "seed is -1"),
    ],
)
def test_malformed_manifests_are_refused_with_the_row(tmp_path, rows, message):
    with pytest.raises(ManifestError, match=message):
        read_manifest(_jsonl(tmp_path / "m.jsonl", rows))


def test_a_rows_choices_and_sampling_are_read(tmp_path):
    row = {"id": "a", "video": "v", "prompt": "p", "n": 3, "temperature": 0.7, "seed": 5, "logprobs": 2}
    (got,) = read_manifest(_jsonl(tmp_path / "m.jsonl", [row]))
    assert (got.n, got.temperature, got.seed, got.logprobs) == (3, 0.7, 5, 2)
    (plain,) = read_manifest(_jsonl(tmp_path / "p.jsonl", [{"id": "a", "video": "v", "prompt": "p"}]))
    assert (plain.n, plain.temperature, plain.seed, plain.logprobs) == (None, None, None, None)


def test_a_rows_response_format_is_kept_as_json_text(tmp_path):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer", "default": None}}}
    m = _jsonl(tmp_path / "m.jsonl", [{"id": "a", "video": "v", "prompt": "p", "response_format": fmt},
                                      {"id": "b", "video": "v", "prompt": "p", "response_format": json.dumps(fmt)},
                                      {"id": "c", "video": "v", "prompt": "p"}])  # fmt: skip
    rows = read_manifest(m)
    assert [json.loads(r.response_format) if r.response_format else None for r in rows] == [fmt, fmt, None]
    # Parquet: JSON text in a string column; a struct column (every key in every row, missing ones null) is refused
    pq.write_table(pa.Table.from_pylist([{"id": "a", "video": "v", "prompt": "p", "response_format": json.dumps(fmt)}]),
                   tmp_path / "ok.parquet")  # fmt: skip
    assert json.loads(read_manifest(tmp_path / "ok.parquet")[0].response_format) == fmt
    pq.write_table(pa.Table.from_pylist([{"id": "a", "video": "v", "prompt": "p", "response_format": fmt}]),
                   tmp_path / "struct.parquet")  # fmt: skip
    with pytest.raises(ManifestError, match="must be a string column of JSON text"):
        read_manifest(tmp_path / "struct.parquet")


def test_manifest_format_is_checked(tmp_path):
    (tmp_path / "m.csv").write_text("id,video,prompt\n")
    with pytest.raises(ManifestError, match=r"parquet or \.jsonl"):
        read_manifest(tmp_path / "m.csv")
    (tmp_path / "m.jsonl").write_text("{not json")
    with pytest.raises(ManifestError, match=r"m\.jsonl:1: not JSON"):
        read_manifest(tmp_path / "m.jsonl")


def _row(rid, status, text=None):
    return empty_row(rid) | {"status": status, "text": text, "error_code": None if status == "ok" else "invalid_media"}


def test_output_keeps_ok_over_error_and_later_over_earlier(tmp_path):
    out = OutputDir(tmp_path)
    out.write_part([_row("a", "error"), _row("b", "ok", "first"), _row("c", "error")])
    out.write_part([_row("a", "ok", "retried"), _row("b", "error")])  # a later error never replaces an ok
    out.write_part([_row("c", "error") | {"error_message": "again"}])
    assert out.done_ids() == {"a", "b"}
    results = pq.read_table(out.finalize(["c", "b", "a", "never"])).to_pylist()
    assert [r["id"] for r in results] == ["c", "b", "a", "never"]
    assert [r["status"] for r in results] == ["error", "ok", "ok", "error"]
    assert results[0]["error_message"] == "again" and results[1]["text"] == "first" and results[2]["text"] == "retried"
    assert results[3]["error_code"] == "not_processed"
    # parts live under _parts/, which dataset readers skip: reading the directory sees only the results
    assert pq.read_table(tmp_path).num_rows == 4
    assert out.write_part([]) is None and not list(tmp_path.glob("_parts/.*.tmp"))


def test_progress_line_and_summary():
    t = [0.0]
    p = Progress(total=10, skipped=2, clock=lambda: t[0])
    for status, code in [("ok", None), ("ok", None), ("error", "invalid_media"), ("ok", None)]:
        p.add(status, code)
    t[0] = 2.0
    assert p.line() == "[prism-batch] 4/8 rows (50%) ok=3 failed=1 skipped=2 rate=2.00 rows/s eta=2s"
    s = p.summary()
    assert s["ok"] == 3 and s["failed"] == 1 and s["errors_by_code"] == {"invalid_media": 1} and s["rows_per_s"] == 2.0
