"""The README's topology table is the committed ``summary.json`` rendered: a figure typed by hand, or a summary
committed without its table, fails here."""

from __future__ import annotations

import copy
import json

from loadtest import readme_table
from loadtest.sweep import START
from tests.paths import ROOT


def _summary() -> dict:
    return json.loads((ROOT / "loadtest" / "results" / "summary.json").read_text())


def test_the_readmes_topology_table_is_the_committed_summary_rendered():
    readme = (ROOT / "README.md").read_text()
    assert readme_table.block(readme) == readme_table.render(_summary())


def test_a_changed_figure_changes_the_table_and_rewrite_puts_it_in_place(tmp_path):
    summary = _summary()
    changed = copy.deepcopy(summary)
    epd = changed["metrics"]["peak_goodput_best_topology_vs_monolith"]["raw"]["topologies"]["EPD"]
    next(p for p in epd["sweep"] if p["rate_rps"] == START)["goodput_rps"] = 9.87  # (every sweep runs START)
    assert "9.87" in readme_table.render(changed) and "9.87" not in readme_table.render(summary)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{readme_table.BEGIN}\nold\n{readme_table.END}\noutro\n")
    readme_table.rewrite(readme, changed)
    text = readme.read_text()
    assert readme_table.block(text) == readme_table.render(changed) and text.startswith("intro\n")
    assert text.endswith("outro\n")


def test_a_topology_measured_in_fewer_runs_than_the_monolith_says_so_in_its_cells():
    changed = copy.deepcopy(_summary())
    topologies = changed["metrics"]["peak_goodput_best_topology_vs_monolith"]["raw"]["topologies"]
    runs = len(changed["metrics"]["ttft_ratio_topology_epd_vs_monolith"]["raw"]["runs"])
    for name in ("EPD", "E/PD"):
        topologies[name]["ttft_p50_s"] = [0.3] * runs
        topologies[name]["ttft_ratio_vs_monolith"] = [1.0] * runs
    topologies["E/PD"]["ttft_p50_s"] = [0.4321]
    topologies["E/PD"]["ttft_ratio_vs_monolith"] = [1.234]
    row = next(r for r in readme_table.render(changed).splitlines() if r.startswith("| TTFT p50, medium"))
    cells = dict(zip(readme_table.TOPOLOGIES, row.split(" | ")[1:], strict=False))
    assert cells["E/PD"] == "432 ms (1 run)" and cells["EPD"] == "300 ms"
    assert "| 1.23 (1 run) |" in readme_table.render(changed)
