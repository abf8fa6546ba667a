"""A request's output constraint (``response_format``, regex, choice, what ``tool_choice`` allows) as it travels
with its sampling parameters.

Built once at the ingress (:func:`common.grammar.formats.guide_from_request`) and checked there against the model's
tokenizer before any stage runs; prefill and decode compile the same ``grammar`` text again from their own bounded
caches (:class:`common.grammar.compiler.GrammarCompiler`), so what crosses a hand-off is this small value, never a
matcher's state: a decode replica rebuilds that state from the tokens (prefill's first token, a migration's replay).
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict

GuideKind = Literal["json_object", "json_schema", "regex", "choice", "tools"]


class Guide(BaseModel):
    """What the output must match: ``grammar`` is the grammar library's own text (llguidance's JSON grammar form)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: GuideKind
    grammar: str
    name: str | None = None
    """The ``json_schema``'s ``name``, for logs (never the schema itself)."""
    param: str = "response_format"
    """The request field it came from (named by a refusal)."""

    @property
    def key(self) -> str:
        """The compile caches' key (with the tokenizer's): a digest of ``grammar``."""
        return hashlib.sha256(self.grammar.encode()).hexdigest()[:32]
