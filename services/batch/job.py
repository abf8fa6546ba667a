"""Offline video batches: ``python -m services.batch --input <manifest> --output <dir> [--config <yaml>]``.

Submit it to a running cluster with ``ray job submit --working-dir . -- python -m services.batch ...`` (or run it
directly: it starts a local Ray). A Ray Data pipeline over the same ``common/`` stage code as online serving:

    manifest rows ─map (CPU tasks: fetch, decode, sample, process)─► pixel tensors in the object store
                  ─map_batches (encode actor pool)─► embeddings
                  ─map_batches (prefill + continuous-batching decode actor pool)─► text + per-stage seconds
                  ─► the driver writes a Parquet part every ``batch.write_every_rows`` rows, logging progress

Resumable: rows already ``ok`` in the output directory are skipped, errors are retried (see
:mod:`common.batch.output`). Every input row gets exactly one row in ``<output>/results.parquet``. The exit status
is 0 when the job ran, whatever the rows' outcomes; 2 when the manifest or config is unusable.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from common.batch.manifest import ManifestError, read_manifest
from common.batch.output import SCHEMA, OutputDir
from common.batch.progress import Progress
from common.config import PrismConfig
from services.batch.pipeline import build_dataset

DEFAULT_MODEL = "prism-tiny-qwen2vl"


def load_config(path: str | None, media_root: Path) -> PrismConfig:
    """A PrismConfig YAML, or a Serve config whose first application's ``args.config`` is one. Local files are
    readable under ``media_root`` (plain paths and ``file://`` in the manifest)."""
    raw: dict[str, Any] = {}
    if path:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if "applications" in raw:
            raw = raw["applications"][0].get("args", {}).get("config", {})
    if not raw.get("models"):
        raw.setdefault("model", {}).setdefault("model", DEFAULT_MODEL)
    media = raw.setdefault("media", {})
    if not media.get("file_root"):
        media["file_root"] = str(media_root.resolve())
    schemes = list(media.get("allowed_schemes", ("https", "http", "data")))
    media["allowed_schemes"] = [*schemes, "file"] if "file" not in schemes else schemes
    return _video_model(PrismConfig.model_validate(raw))


def _video_model(cfg: PrismConfig) -> PrismConfig:
    """The one-model config of the model the job runs — ``batch.model``, or the first of ``models`` that takes
    video — refused (``ValueError``: exit 2, before Ray starts) when that model cannot take video."""
    from common.model.builder import resolve_model_dir
    from common.model.registry import family_for_dir

    def takes_video(sub: PrismConfig) -> bool:
        return "video" in family_for_dir(resolve_model_dir(sub.model.model, sub.model.cache_dir)).modalities

    served = cfg.served()
    if cfg.batch.model is not None:
        chosen = [sub for sub in served if sub.model.name == cfg.batch.model]
        if not chosen:
            names = ", ".join(sub.model.name for sub in served)
            raise ValueError(f"batch.model {cfg.batch.model!r} is not among the config's models ({names})")
        sub = chosen[0]
        video = takes_video(sub)
    else:  # the first that takes video (each model's family looked up once)
        sub, video = next(((s, True) for s in served if takes_video(s)), (served[0], False))
    if not video:
        raise ValueError(
            f"model {sub.model.name} cannot take video; give a video-capable model (e.g. {DEFAULT_MODEL}) in the "
            "config, or leave --config out"
        )
    return sub


def _output_row(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for field in SCHEMA:
        value = row.get(field.name)
        out[field.name] = value.item() if isinstance(value, np.generic) else value
    if out["status"] == "ok":
        out["error_code"] = out["error_message"] = None
    else:
        out["text"] = None
    return out


def run(manifest: str, output: str, config: str | None = None, media_root: str | None = None) -> dict[str, Any]:
    root = Path(media_root) if media_root else Path(manifest).resolve().parent
    cfg = load_config(config, root)
    rows = read_manifest(manifest, root)
    out = OutputDir(output)
    done = out.done_ids()
    todo = [asdict(r) for r in rows if r.id not in done]
    progress = Progress(len(rows), skipped=len(rows) - len(todo))
    _log(f"[prism-batch] {len(rows)} rows, {len(done & {r.id for r in rows})} already ok, {len(todo)} to process")
    if todo:
        import ray

        ray.init(ignore_reinit_error=True, log_to_driver=False)  # joins the job's cluster, or starts a local one
        pending: list[dict[str, Any]] = []
        last_log = time.monotonic()
        try:
            for row in build_dataset(todo, cfg).iter_rows():
                result = _output_row(row)
                pending.append(result)
                progress.add(result["status"], result["error_code"])
                if len(pending) >= cfg.batch.write_every_rows:
                    out.write_part(pending)
                    pending = []
                    _log(progress.line())
                    last_log = time.monotonic()
                elif time.monotonic() - last_log >= cfg.batch.progress_interval_s:
                    _log(progress.line())
                    last_log = time.monotonic()
        finally:  # a pipeline that dies still leaves every finished row on disk: a re-run resumes after them
            out.write_part(pending)
            _log(progress.line())
    results = out.finalize([r.id for r in rows])
    summary = {**progress.summary(), "results": str(results)}
    _log("[prism-batch] summary " + json.dumps(summary, sort_keys=True))
    return summary


def _log(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="manifest: .parquet or .jsonl (id, video, prompt, ...)")
    parser.add_argument("--output", required=True, help="output directory (re-use it to resume)")
    parser.add_argument("--config", help="PrismConfig YAML, or a Serve config (its first application's config)")
    parser.add_argument("--media-root", help="directory local videos may be read from (default: the manifest's)")
    args = parser.parse_args(argv)
    try:
        summary = run(args.input, args.output, args.config, args.media_root)
    except (ManifestError, ValueError, OSError) as exc:
        print(f"[prism-batch] cannot run: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # the pipeline itself failed; the rows it finished are written
        print(f"[prism-batch] stopped by {type(exc).__name__}; finished rows are saved, re-run to resume",
              file=sys.stderr, flush=True)  # fmt: skip
        return 1
    print(summary["results"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
