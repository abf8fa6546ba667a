"""The offline video batch job on a real local Ray cluster: one row per input with the expected statuses, text equal
to the online path's (greedy), resumable after a kill, and submittable with ``ray job submit``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq
import pytest
import yaml

from common.config import PrismConfig
from tests.batch.conftest import ERRORS, GOOD, RAY, SCHEMA, job_env

ROOT = Path(__file__).resolve().parents[2]


def _job(args: list[str], address: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "services.batch", *args]
    return subprocess.run(cmd, cwd=ROOT, env=job_env(address), capture_output=True, text=True, timeout=timeout)


def _results(out: Path) -> list[dict]:
    return pq.read_table(out / "results.parquet").to_pylist()


def _reference_texts(config_path: Path, manifest: Path) -> dict[str, str]:
    """What the online path answers for each good clip (temperature 0): the in-process reference, which the deployed
    Qwen2-VL app matches token for token (tests/e2e/test_video.py)."""
    from common.batch.manifest import read_manifest
    from common.grammar.formats import guide_from_request
    from common.model.loader import load_model
    from common.protocol.handoff import MediaRef
    from common.protocol.sampling import SamplingParams
    from common.stages.stops import visible_text
    from services.batch.job import load_config
    from tests.reference import media_tokens

    cfg = load_config(str(config_path), manifest.parent)
    lm = load_model(cfg.model)
    texts = {}
    for row in read_manifest(manifest):
        if row.id in ERRORS:
            continue
        rf = {"response_format": json.loads(row.response_format)} if row.response_format else {}
        sampling = SamplingParams(max_tokens=row.max_tokens or cfg.batch.default_max_tokens,
                                  temperature=row.temperature or 0, seed=row.seed or 0,
                                  guide=guide_from_request(rf, 1 << 16))  # fmt: skip
        ref = MediaRef("video", row.video, fps=row.fps)
        eng = cfg.engine
        texts[row.id] = []
        for i in range(row.n or 1):  # (each choice as its own request, with its seed)
            own = sampling.for_choice(i)
            ids = media_tokens(lm, ref, row.prompt, own, cfg.media, eng.max_prompt_tokens, eng.kv_block_size)
            texts[row.id].append(visible_text(lm.tokenizer, ids, own))
    return texts


@pytest.fixture(scope="module")
def first_run(clips, ray_cluster, tmp_path_factory):
    manifest, config, _ = clips
    out = tmp_path_factory.mktemp("out")
    proc = _job(["--input", str(manifest), "--output", str(out), "--config", str(config)], ray_cluster[0])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_one_row_per_input_with_the_expected_statuses(clips, first_run):
    out, proc = first_run
    rows = _results(out)
    manifest_ids = [c[0] for c in GOOD] + list(ERRORS)
    assert [r["id"] for r in rows] == manifest_ids
    by_id = {r["id"]: r for r in rows}
    for cid, code in ERRORS.items():
        assert by_id[cid]["status"] == "error" and by_id[cid]["error_code"] == code, by_id[cid]
        assert by_id[cid]["error_message"] and by_id[cid]["text"] is None
    for cid, *_ in GOOD:
        row = by_id[cid]
        assert row["status"] == "ok" and row["error_code"] is None, row
        assert row["frames"] >= 1 and row["visual_tokens"] > 0 and row["prompt_tokens"] > row["visual_tokens"]
        bound = 40 if cid in ("clip-01", "clip-02") else 10 * len(json.loads(row["choices"]))
        assert 1 <= row["output_tokens"] <= bound
        assert all(row[f"seconds_{s}"] >= 0 for s in ("fetch_decode", "process", "encode", "prefill", "decode"))
    # frame sampling follows the server policy (2 fps by default) and a row's lower fps
    assert by_id["clip-07"]["frames"] > by_id["clip-00"]["frames"]  # 3.0 s vs 0.5 s
    # progress and the summary are in the job's log
    for cid in ("clip-01", "clip-02"):  # answered under the row's JSON schema
        jsonschema.validate(json.loads(by_id[cid]["text"]), SCHEMA)
    assert "[prism-batch] 21/21 rows (100%) ok=17 failed=4" in proc.stdout
    summary = json.loads(proc.stdout.split("[prism-batch] summary ", 1)[1].splitlines()[0])
    assert (
        summary["ok"] == 17
        and summary["failed"] == 4
        and summary["errors_by_code"]
        == {
            "invalid_media": 1,
            "invalid_response_format": 1,
            "media_fetch_failed": 1,
            "media_too_large": 1,
        }
    )
    assert proc.stdout.strip().splitlines()[-1] == str(out / "results.parquet")


def test_ok_rows_text_equals_the_online_path(clips, first_run):
    manifest, config, _ = clips
    out, _ = first_run
    reference = _reference_texts(config, manifest)
    ok = [r for r in _results(out) if r["status"] == "ok"]
    got = {r["id"]: [c["text"] for c in json.loads(r["choices"])] for r in ok}
    assert got == reference
    assert all(r["text"] == got[r["id"]][0] for r in ok)  # (``text``: choice 0's)
    sampled = [texts for texts in got.values() if len(texts) == 3]
    assert len(sampled) == 2 and all(len(set(texts)) > 1 for texts in sampled), "seed + i: the choices differ"


def test_rows_that_ask_for_logprobs_get_them(first_run):
    """Rows with ``logprobs: 2`` carry the online API's entries as JSON: one per output token, whose bytes spell the
    text, each with two alternatives — the first of which is the (greedy) token itself; other rows carry none."""
    out, _ = first_run
    rows = {r["id"]: r for r in _results(out) if r["status"] == "ok"}
    asked = [r for r in rows.values() if r["logprobs"]]
    assert len(asked) == 2 and all(not r["logprobs"] for r in rows.values() if r not in asked)
    for row in asked:
        entries = json.loads(row["logprobs"])
        assert len(entries) == row["output_tokens"]
        assert all(len(e["top_logprobs"]) == 2 for e in entries)
        assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in entries)
        assert all(abs(e["top_logprobs"][0]["logprob"] - e["logprob"]) < 1e-6 for e in entries)
        assert row["text"] in b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", errors="replace")


def test_rerun_skips_ok_rows_and_retries_errors(clips, first_run, ray_cluster):
    manifest, config, _ = clips
    out, _ = first_run
    before = {r["id"]: r for r in _results(out)}
    parts = len(list((out / "_parts").glob("part-*.parquet")))
    proc = _job(["--input", str(manifest), "--output", str(out), "--config", str(config)], ray_cluster[0])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "21 rows, 17 already ok, 4 to process" in proc.stdout
    after = _results(out)
    assert len(after) == 21 and {r["id"]: r for r in after} == before  # errors retried, still errors
    assert len(list((out / "_parts").glob("part-*.parquet"))) == parts + 1


def test_a_killed_job_loses_at_most_its_in_flight_rows(clips, ray_cluster, tmp_path):
    manifest, config, _ = clips
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "services.batch", "--input", str(manifest), "--output", str(out), "--config",
           str(config)]  # fmt: skip
    job = subprocess.Popen(
        cmd, cwd=ROOT, env=job_env(ray_cluster[0]), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + 240
    while time.time() < deadline and not list((out / "_parts").glob("part-*.parquet")):
        time.sleep(0.2)
    job.send_signal(signal.SIGKILL)
    job.wait(30)
    written = pq.read_table(out / "_parts").to_pylist() if (out / "_parts").exists() else []
    saved_ok = {r["id"] for r in written if r["status"] == "ok"}
    assert written and not (out / "results.parquet").exists(), job.stderr.read()[-2000:]
    proc = _job(["--input", str(manifest), "--output", str(out), "--config", str(config)], ray_cluster[0])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"21 rows, {len(saved_ok)} already ok, {21 - len(saved_ok)} to process" in proc.stdout
    rows = _results(out)
    assert len(rows) == 21 and sum(r["status"] == "ok" for r in rows) == 17


def test_ray_job_submit_runs_the_job(clips, ray_cluster, tmp_path):
    _, config, root = clips
    rows = [{"id": c[0], "video": str(root / f"{c[0]}.{c[4]}"), "prompt": "What happens?"} for c in GOOD[:3]]
    lines = [json.dumps(r) for r in rows]
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(lines))
    out = tmp_path / "submitted"
    cmd = [RAY, "job", "submit", "--address", ray_cluster[1], "--working-dir", str(ROOT), "--",
           sys.executable, "-m", "services.batch", "--input", str(small), "--output", str(out),
           "--config", str(config), "--media-root", str(root)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(""), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout.lower()
    assert "[prism-batch] summary" in proc.stdout  # the job's log (progress + summary) streamed back
    rows = _results(out)
    assert [r["id"] for r in rows] == [c[0] for c in GOOD[:3]] and all(r["status"] == "ok" for r in rows)


def test_a_malformed_manifest_refuses_to_start(tmp_path, ray_cluster):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "video": "a.mp4", "prompt": "x"}) + "\n" + json.dumps({"id": "a"}) + "\n")
    proc = _job(["--input", str(bad), "--output", str(tmp_path / "o")], ray_cluster[0], timeout=120)
    assert proc.returncode == 2 and "row 2: missing video, prompt" in proc.stderr


def test_config_accepts_a_serve_config_and_opens_only_the_media_root(tmp_path):
    from services.batch.job import load_config

    serve = yaml.safe_load((ROOT / "ray_configs" / "local_cpu.yaml").read_text())
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(serve))
    cfg = load_config(str(path), tmp_path)
    assert isinstance(cfg, PrismConfig) and cfg.media.file_root == str(tmp_path.resolve())
    assert "file" in cfg.media.allowed_schemes
    assert cfg.model.name == "prism-tiny-qwen2vl" and not cfg.models, "of several models, the first video-capable"


def _models_config(tmp_path: Path, model_cache: str, **batch) -> Path:
    models = [{"model": m, "cache_dir": model_cache} for m in ("prism-tiny-llava", "prism-tiny-qwen2vl")]
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": models, "batch": batch}))
    return path


def test_batch_model_picks_one_of_several_and_must_take_video(tmp_path, model_cache):
    from services.batch.job import load_config

    assert load_config(str(_models_config(tmp_path, model_cache)), tmp_path).model.name == "prism-tiny-qwen2vl"
    picked = load_config(str(_models_config(tmp_path, model_cache, model="prism-tiny-qwen2vl")), tmp_path)
    assert picked.model.name == "prism-tiny-qwen2vl"
    with pytest.raises(ValueError, match="cannot take video"):
        load_config(str(_models_config(tmp_path, model_cache, model="prism-tiny-llava")), tmp_path)
    with pytest.raises(ValueError, match="not among the config's models"):
        load_config(str(_models_config(tmp_path, model_cache, model="nope")), tmp_path)


def _make_batch(args: list[str], address: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "batch", *args], cwd=ROOT, env=job_env(address), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_make_batch_as_the_readme_writes_it(clips, ray_cluster, tmp_path):
    """``make batch INPUT=… OUTPUT=…`` — no CONFIG: the job's own video-capable default, not serve's config."""
    _, _, root = clips
    rows = [{"id": c[0], "video": f"{c[0]}.{c[4]}", "prompt": "What happens?", "max_tokens": 4} for c in GOOD[:3]]
    rows.append({"id": "missing", "video": "missing.mp4", "prompt": "What happens?", "max_tokens": 4})
    manifest = root / "readme.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    proc = _make_batch([f"INPUT={manifest}", f"OUTPUT={out}"], ray_cluster[0], 300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {r["id"]: (r["status"], r["error_code"]) for r in _results(out)}
    assert got == {**{c[0]: ("ok", None) for c in GOOD[:3]}, "missing": ("error", "media_fetch_failed")}


def test_make_batch_refuses_an_image_only_config_before_ray_starts(clips, tmp_path, model_cache):
    manifest, _, _ = clips
    llava = tmp_path / "llava.yaml"
    llava.write_text(yaml.safe_dump({"model": {"model": "prism-tiny-llava", "cache_dir": model_cache}}))
    start = time.monotonic()
    proc = _make_batch([f"INPUT={manifest}", f"OUTPUT={tmp_path / 'o'}", f"CONFIG={llava}"], "", 120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "prism-tiny-llava cannot take video" in proc.stderr
    assert time.monotonic() - start < 30 and not (tmp_path / "o").exists()
