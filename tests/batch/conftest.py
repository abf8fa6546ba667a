"""A real local Ray cluster (head with the job server) started with ``ray start``, and a manifest of real clips.

The cluster runs in its own processes (``ray start --head --block`` in a new process group), so this pytest process
never joins Ray here: the jobs under test are separate drivers, exactly as in production.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.mediakit import video_bytes
from tests.netutil import free_port, wait_for_http

QWEN = "prism-tiny-qwen2vl"
RAY = str(Path(sys.executable).with_name("ray"))

# (id, seconds, fps, size, format) of the good clips: different lengths, frame rates, sizes and containers.
GOOD = [
    (f"clip-{i:02d}", secs, fps, size, fmt)
    for i, (secs, fps, size, fmt) in enumerate(
        [
            (0.5, 10, (64, 48), "mp4"),
            (1.0, 8, (64, 48), "webm"),
            (1.5, 6, (96, 72), "mp4"),
            (2.0, 5, (80, 60), "webm"),
            (1.0, 12, (64, 64), "mp4"),
            (2.5, 4, (112, 84), "mp4"),
            (0.8, 10, (48, 48), "webm"),
            (3.0, 5, (64, 48), "mp4"),
            (1.2, 10, (96, 64), "webm"),
            (0.6, 5, (64, 48), "mp4"),
            (1.8, 10, (80, 80), "mp4"),
            (2.2, 6, (64, 48), "webm"),
            (1.0, 4, (128, 96), "mp4"),
            (0.7, 12, (64, 48), "mp4"),
            (1.4, 8, (72, 54), "webm"),
            (2.8, 5, (64, 48), "mp4"),
            (1.1, 9, (96, 96), "mp4"),
        ]
    )
]
ERRORS = {
    "corrupt": "invalid_media",
    "too-long": "media_too_large",
    "missing": "media_fetch_failed",
    "bad-schema": "invalid_response_format",
}
SCHEMA = {"type": "object", "properties": {"seen": {"enum": ["cat", "car", "sky"]}, "count": {"type": "integer",
          "minimum": 0, "maximum": 9}}, "required": ["seen", "count"], "additionalProperties": False}  # fmt: skip
"""The output constraint of clips 1 and 2 (a JSON object in the Parquet manifest's string column)."""
UNSATISFIABLE = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 2,
                                                                                "maximum": 1}}}  # fmt: skip
PROMPTS = ["What happens?", "Describe the clip.", "Summarise it in a few words."]


@pytest.fixture(scope="package")
def clips(tmp_path_factory, model_cache):
    """(manifest path, config path, media dir): 17 good clips (two answering under a JSON schema, two with three
    sampled choices), one corrupt, one over the duration cap, one missing, one whose JSON schema is unsatisfiable."""
    from common.model.builder import resolve_model_dir

    resolve_model_dir(QWEN, model_cache)  # built once here, not in every worker
    root = tmp_path_factory.mktemp("videos")
    rows = []
    for n, (cid, secs, fps, size, fmt) in enumerate(GOOD):
        name = f"{cid}.{fmt}"
        (root / name).write_bytes(video_bytes(secs, fps=fps, size=size, fmt=fmt))
        row = {"id": cid, "video": name, "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": None, "fps": None}
        if n % 4 == 0:
            row["max_tokens"] = 6
        if n % 5 == 0:
            row["fps"] = 2.0
        if n in (1, 2):
            row["response_format"] = json.dumps({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
            row["max_tokens"] = 40
        if n in (3, 4):  # (free rows: greedy takes the raw distribution's top token)
            row["logprobs"] = 2
        if n in (5, 6):  # three sampled choices of one prefill (choice i with seed + i)
            row |= {"n": 3, "temperature": 1.0, "seed": 11 + n}
        rows.append(row)
    (root / "corrupt.mp4").write_bytes(video_bytes(1.0)[:300] + b"\x00" * 200)
    (root / "too-long.mp4").write_bytes(video_bytes(6.0, fps=4))
    for cid in ERRORS:
        rows.append({"id": cid, "video": f"{cid}.mp4", "prompt": "What happens?", "max_tokens": None, "fps": None})
    rows[-1] |= {"video": "clip-00.mp4", "response_format": json.dumps(UNSATISFIABLE)}  # (refused before its fetch)
    manifest = root / "manifest.parquet"
    text, number = pa.string(), pa.float64()
    schema = pa.schema([("id", text), ("video", text), ("prompt", text), ("max_tokens", pa.int64()), ("fps", number),
                        ("response_format", text), ("logprobs", pa.int64()), ("n", pa.int64()),
                        ("temperature", number), ("seed", pa.int64())])  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), manifest)
    config = root / "batch.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"model": QWEN, "cache_dir": model_cache, "torch_threads": 1},
                "media": {"video": {"max_duration_s": 4.0}},
                "batch": {"write_every_rows": 4, "generate_batch_size": 4, "default_max_tokens": 10},
            }
        )
    )
    return manifest, config, root


@pytest.fixture(scope="package")
def ray_cluster():
    """(GCS address, job server URL) of a local head started with the job server."""
    port, dash = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [RAY, "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--include-dashboard=true",
           f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1"]  # fmt: skip
    head = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{dash}"
    if not wait_for_http(f"{url}/api/version", head, 90):
        os.killpg(head.pid, signal.SIGKILL)
        raise RuntimeError("the Ray head did not start")
    yield f"127.0.0.1:{port}", url
    os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the processes it started
    try:
        head.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)


def job_env(address: str) -> dict[str, str]:
    return {**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
