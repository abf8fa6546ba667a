"""Where the repository is, for tests that read its files (configs, the chart, the README and docs) wherever they sit
in the tree."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
