"""``python -m loadtest.priorities``: a setting names the three throughput stages' niceness, the application it runs
is the bench's with those and nothing else changed, and a bad setting is refused before anything starts."""

from __future__ import annotations

import pytest

from common.config import PrismConfig
from loadtest.bench import app_config
from loadtest.priorities import DEFAULT, configured, main, parse_setting


def test_the_default_setting_is_the_configs_own_defaults():
    stages = PrismConfig().deployments
    assert parse_setting(DEFAULT) == (stages.media.cpu_nice, stages.encode.cpu_nice, stages.prefill.long_lane_nice)


def test_a_setting_changes_only_the_three_niceness_values_of_the_benchs_application():
    base = app_config("prism-small-llava")
    cfg = configured(base, (19, 0, 5))
    parsed = PrismConfig.model_validate(cfg).deployments
    assert (parsed.media.cpu_nice, parsed.encode.cpu_nice, parsed.prefill.long_lane_nice) == (19, 0, 5)
    assert parsed.decode.cpu_nice == 0 and "cpu_nice" not in base["deployments"]["encode"]  # (the input untouched)
    rest = {k: v for k, v in cfg.items() if k != "deployments"}
    assert rest == {k: v for k, v in base.items() if k != "deployments"}


@pytest.mark.parametrize("bad", ["19-18", "19-18-20", "a-b-c", "19--1-0"])
def test_a_bad_setting_is_refused_before_any_server_starts(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--settings", bad])
    assert exit_.value.code == 2 and f"setting {bad!r}" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--runs", "0"], ["--rate", "0"], ["--duration", "-1"], ["--settings", ","]])
def test_nothing_to_measure_is_refused_before_any_server_starts(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and "at least one setting" in capsys.readouterr().err
