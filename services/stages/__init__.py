"""The stage deployments — media, encode, prefill, decode — each a thin Serve class around a ``common/`` engine, with
the plumbing they share: the engine ``driver``, OS ``threads`` and priorities, and the stage ``admission`` (a budget
gate with its metrics)."""
