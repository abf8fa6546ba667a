"""The tags around one tool call in the answer: ``<tool_call>`` … ``</tool_call>`` (Qwen2.5's format, which the built
models' chat templates use — :mod:`common.model.families.tool_format`). The built tokenizers have each as a single
plain token; the grammar (:mod:`common.tools.grammar`) and the reader (:mod:`common.tools.calls`) work with either."""

from __future__ import annotations

TOOL_MARKERS = ("<tool_call>", "</tool_call>")
"""Opening and closing tags of one call."""
