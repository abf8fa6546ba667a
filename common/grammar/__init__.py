"""Grammar-constrained decoding (structured outputs), on llguidance.

Lifecycle of one constrained request:

1. **ingress** — :func:`~common.grammar.formats.guide_from_request` turns ``response_format`` (or a vLLM-style
   ``structured_outputs`` / ``guided_*`` extension) into a :class:`~common.grammar.guide.Guide`: the constraint as
   grammar text, size-checked; :meth:`~common.grammar.compiler.GrammarCompiler.check` then compiles it against the
   model's tokenizer (bounded by the library's parser limits) — an unsatisfiable, unsupported or too-large schema is a
   400 ``invalid_response_format`` before any media, encode or prefill work. The guide rides in the request's
   :class:`~common.protocol.sampling.SamplingParams`.
2. **prefill** — the first token is sampled under the guide's mask (a fresh matcher, dropped after).
3. **decode** — each sequence holds its own matcher, built from the compiler's bounded cache of compiled grammars
   (keyed by the grammar's digest; the compiler is per tokenizer) and advanced by prefill's first token and by any
   replayed tokens (decode migration), so its state is a function of the tokens alone. Every batched step fills the
   masks of all constrained sequences at once (:class:`~common.grammar.masks.MaskBuffer`, the library's thread pool)
   and sets the disallowed logits of those rows to -1e30 before penalties, greedy, temperature and top-p; rows of
   unconstrained sequences are not touched. A sequence whose grammar is complete ends with ``stop`` (at
   ``max_tokens`` too); one cut short by ``max_tokens`` ends with ``length``; one whose grammar fails mid-way (the
   library compiles lazily: a parser limit can be met at a step) ends with an ``error`` event, never with output the
   grammar did not accept.

JSON is compact by default (no free whitespace between tokens), so a bounded schema always terminates.
"""
