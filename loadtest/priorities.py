"""What the throughput stages' OS priority trades: ``python -m loadtest.priorities``.

Not part of ``make test`` or ``make bench`` (about nine minutes per setting at three runs). For each setting of
``media.cpu_nice``-``encode.cpu_nice``-``prefill.long_lane_nice`` (``19-18-0`` is the default), it starts the
bench's Prism application (:func:`loadtest.bench.app_config`, E/P/D, on a local Ray cluster of this process) with
those niceness values, warms it up and then, per run:

1. the bench's mixed load (:func:`loadtest.bench_loads.mixed`: text, one image and several images, cold and repeated,
   8–32 output tokens) open-loop at ``--rate`` (4 rps: past Prism's capacity here, below the monolith's), and
   reads its goodput (requests meeting TTFT ≤ 2 s and mean ITL ≤ 0.2 s per second) and TTFT p95;
2. the bench's ``text_ttft_p95_flood_vs_idle`` load (text probes idle, then under one tenant's large-image flood);
3. its ``tenant_ttft_p95_flood_vs_idle`` load (the same, the flood from another API key).

Run ``i`` uses the seeds the bench's figures use for their run ``i`` (the mixed load: the sweep's one sequence of
requests, with the images of its 4-rps point plus ``i``, whatever ``--rate``), so settings compare on the same
requests. It prints one JSON object per setting: each run's values and their medians. The niceness of each stage is a
setting of the config (``deployments.<stage>.cpu_nice``, ``deployments.prefill.long_lane_nice``); ``docs/limits.md``
("What the priority costs") gives what this measured.

    python -m loadtest.priorities [--settings 19-18-0,19-18-18] [--runs 3] [--rate 4] [--duration 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from common.config.deployments import EncodeStageConfig, MediaStageConfig, PrefillStageConfig

DEFAULT = "-".join(
    str(stage.model_fields[field].default)
    for stage, field in (
        (MediaStageConfig, "cpu_nice"),
        (EncodeStageConfig, "cpu_nice"),
        (PrefillStageConfig, "long_lane_nice"),
    )
)
"""The config's own defaults (media 19, encode 18, the prefill's long lane 0), read from its fields."""


def parse_setting(text: str) -> tuple[int, int, int]:
    """``"19-0-0"`` → (media, encode, long lane) niceness, each 0–19."""
    parts = text.split("-")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"setting {text!r}: expected MEDIA-ENCODE-LONGLANE niceness, e.g. 19-18-18")
    values = tuple(int(p) for p in parts)
    if any(v > 19 for v in values):
        raise ValueError(f"setting {text!r}: a niceness is 0–19")
    return values  # type: ignore[return-value]


def configured(config: dict[str, Any], setting: tuple[int, int, int]) -> dict[str, Any]:
    """``config`` (the bench's application) with the setting's niceness on its media, encode and long lane."""
    media, encode, long_lane = setting
    stages = {name: dict(stage) for name, stage in config["deployments"].items()}
    stages["media"]["cpu_nice"] = media
    stages["encode"]["cpu_nice"] = encode
    stages["prefill"]["long_lane_nice"] = long_lane
    return {**config, "deployments": stages}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def measure(setting: tuple[int, int, int], runs: int, rate: float, duration: float) -> dict[str, Any]:
    from loadtest import bench_loads as loads
    from loadtest import bench_servers as servers
    from loadtest.bench import app_config
    from loadtest.bench_sessions import warm_up
    from loadtest.sweep import RATES, run_seconds

    model = "prism-small-llava"
    images = loads.seed_of("sweep") + RATES.index(4.0)  # (the bench sweep's load at its 4-rps point)
    keys = {"flood_key": servers.ALPHA, "probe_key": servers.BETA}
    out: dict[str, Any] = {"goodput_rps": [], "ttft_p95_s": [], "text_flood_vs_idle": [], "tenant_flood_vs_idle": []}
    with servers.prism_app(configured(app_config(model), setting)) as url:
        warm_up(url, model)
        for i in range(runs):
            seconds = run_seconds(rate, duration)
            summary, _ = loads.mixed(url, model, rate, seconds, loads.SWEEP_SEQUENCE, images + i)
            out["goodput_rps"].append(_round(summary["goodput_rps"]))
            out["ttft_p95_s"].append(_round(summary["ttft_s"]["p95"]))
            out["text_flood_vs_idle"].append(_round(loads.flood(url, model, duration, loads.seed_of("flood", i)).ratio))
            tenant = loads.flood(url, model, duration, loads.seed_of("tenant_flood", i), **keys)
            out["tenant_flood_vs_idle"].append(_round(tenant.ratio))
    return {"medians": {name: _median(values) for name, values in out.items()}, "runs": out}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.priorities", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--settings", default=f"{DEFAULT},19-18-18", help="MEDIA-ENCODE-LONGLANE niceness, comma-separated"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s of the mixed load")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per load run (at least)")
    args = parser.parse_args(argv)
    try:
        settings = [parse_setting(s.strip()) for s in args.settings.split(",") if s.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if not settings or args.runs < 1 or args.rate <= 0 or args.duration <= 0:
        parser.error("give at least one setting, --runs ≥ 1, and a --rate and --duration above 0")
    for setting in settings:
        result = measure(setting, args.runs, args.rate, args.duration)
        print(json.dumps({"setting": "-".join(map(str, setting)), "rate_rps": args.rate, **result}), flush=True)


if __name__ == "__main__":
    main()
