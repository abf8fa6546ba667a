"""The reference path: one request, one sequence, transformers' own ``DynamicCache``, nothing batched or paged.

:mod:`.prefill` and :mod:`.decode` are what the served engines (:mod:`common.engine`) must match token for token, and
:mod:`.pipeline` chains every stage in one process (the exactness tests' oracle next to ``model.generate()``, and
``make demo``). Nothing served imports this package; it shares the served helpers (prompt, merge, sampler, stops)
so that a difference between it and the engines can only come from batching, paging or chunking.
"""
