"""The chart README's values table, generated from the ``# --`` comments in ``values.yaml`` (helm-docs style).

``python -m tests.helm.values_table`` prints it; a test checks the README holds exactly these rows.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

VALUES = Path(__file__).resolve().parents[2] / "helm" / "prism" / "values.yaml"


def rows() -> list[str]:
    text = VALUES.read_text(encoding="utf-8")
    values = yaml.safe_load(text)
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    out = []
    for line in text.splitlines():
        if m := re.match(r"^\s*# -- (.*)$", line):
            pending = [m.group(1)]
            continue
        if (m := re.match(r"^\s*#\s?(.*)$", line)) and pending:
            pending.append(m.group(1))
            continue
        if not (m := re.match(r"^(\s*)([A-Za-z0-9_.]+):", line)):
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        if pending:
            node = values
            for _, key in stack:
                node = node[key]
            default = yaml.safe_dump(node, default_flow_style=True, width=1000).strip().removesuffix("...").strip()
            default = default if len(default) <= 60 else default[:57] + "..."
            out.append(f"| `{'.'.join(k for _, k in stack)}` | `{default}` | {' '.join(pending)} |")
            pending = []
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
