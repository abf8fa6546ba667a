"""One model's grammar compiler: llguidance's view of the tokenizer, a bounded cache of compiled grammars, counters.

:func:`compiler_for` gives each process one :class:`GrammarCompiler` per model directory (the ingress, prefill and
decode each build their own the first time a constrained request reaches them; building the tokenizer view takes
milliseconds for our vocabularies, ~1 s for a 150k one). A grammar is compiled once into a pristine matcher kept in an
LRU (``cache_size`` grammars, keyed by the guide's digest); every sequence gets a deep copy of it — copying is far
cheaper than compiling (which can take 0.1–1 s for a large schema, with the GIL released).

Compiling is bounded by :data:`LIMITS` (the library's parser limits: grammar size, lexer fuel per compile and per
step); a grammar past them fails its :meth:`GrammarCompiler.check` like an unsatisfiable one.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf

from common.cache.lru import ByteLRU
from common.errors import InvalidRequestError
from common.grammar.guide import Guide

LIMITS = dict(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_lexer_states=100_000)
"""llguidance parser limits for every compile and step (its defaults, with a smaller grammar and lexer-state cap)."""
MAX_ERROR_CHARS = 200
_QUOTED = re.compile(r"\"[^\"]*\"|'[^']*'")
_KEYWORD = re.compile(r"[$A-Za-z_]{1,32}")


@dataclass
class CompileStats:
    compiles: int = 0
    hits: int = 0
    refused: int = 0
    compile_s: float = 0.0


class GrammarCompiler:
    """Compiles guides for one tokenizer; thread-safe (the ingress checks from worker threads)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], cache_size: int = 64) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self.cache_size = cache_size
        self._cache: ByteLRU[llguidance.LLMatcher] = ByteLRU(cache_size)  # (each grammar weighs 1: a count bound)
        self._compiled = CompileStats()
        self._lock = threading.Lock()

    @property
    def stats(self) -> CompileStats:
        """Compiles, refusals and compile seconds so far; ``hits``: compiled grammars found in the cache."""
        with self._lock:
            return CompileStats(**{**self._compiled.__dict__, "hits": self._cache.stats().hits})

    @staticmethod
    def limits() -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(verbose_errors=False, **LIMITS)

    def _pristine(self, guide: Guide) -> llguidance.LLMatcher:
        """``guide``'s compiled grammar at its start (cached; never advanced); 400 if it does not compile."""
        pristine = self._cache.get(guide.key)
        if pristine is not None:
            return pristine
        started = time.perf_counter()
        # (compiled outside any lock: it releases the GIL and may take a while; two threads may race on one grammar,
        # and the cache keeps the last)
        pristine = llguidance.LLMatcher(self.tokenizer, guide.grammar, log_level=0, limits=self.limits())
        with self._lock:
            self._compiled.compiles += 1
            self._compiled.compile_s += time.perf_counter() - started
            if pristine.is_error():
                self._compiled.refused += 1
                raise _refusal(guide, pristine.get_error())
        self._cache.put(guide.key, pristine, 1)
        return pristine

    def matcher(self, guide: Guide) -> llguidance.LLMatcher:
        """A fresh matcher for ``guide`` at its start (a copy of the compiled one); 400 ``invalid_response_format``
        if it does not compile."""
        return self._pristine(guide).deep_copy()

    def cached(self, guide: Guide) -> bool:
        """Whether ``guide``'s grammar is compiled already (its check would cost a lookup, not a compile)."""
        return guide.key in self._cache

    def check(self, guide: Guide) -> None:
        """Refuse (400) a guide that does not compile for this tokenizer — the ingress's check before any stage; the
        compiled grammar stays cached for the next request with the same constraint (no copy is made)."""
        self._pristine(guide)


def _refusal(guide: Guide, error: str) -> InvalidRequestError:
    # (the library's first line names the problem — "Unsatisfiable schema…", "Unimplemented keys…", a limit)
    reason = (error.strip().splitlines() or ["does not compile"])[0][:MAX_ERROR_CHARS]
    # Quoted pieces of the client's schema or regex are not echoed; JSON Schema keywords (identifiers) are kept.
    reason = _QUOTED.sub(lambda m: m[0] if _KEYWORD.fullmatch(m[0][1:-1]) else m[0][0] + "…" + m[0][0], reason)
    what = {"json_object": "the JSON object format", "json_schema": "the JSON schema", "regex": "the regex",
            "tools": "the tools' parameters"}  # fmt: skip
    return InvalidRequestError(
        f"{what.get(guide.kind, 'the choice list')} cannot be served: {reason}",
        code="invalid_tools" if guide.kind == "tools" else "invalid_response_format",
        param=guide.param,
    )


_compilers: dict[tuple[str, int], GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def process_stats() -> CompileStats:
    """The compile counters of every compiler in this process, summed (what its metrics report)."""
    total = CompileStats()
    with _compilers_lock:
        for compiler in _compilers.values():
            stats = compiler.stats
            for name in ("compiles", "hits", "refused", "compile_s"):
                setattr(total, name, getattr(total, name) + getattr(stats, name))
    return total


def compiler_for(model: Any) -> GrammarCompiler:
    """This process's compiler for a loaded model or frontend (anything with ``model_dir``, ``tokenizer``,
    ``text_config`` and ``eos_token_ids``)."""
    vocab = int(model.text_config.vocab_size)
    key = (str(model.model_dir), vocab)
    with _compilers_lock:
        found = _compilers.get(key)
        if found is None:
            found = _compilers[key] = GrammarCompiler(model.tokenizer, vocab, model.eos_token_ids)
        return found
