"""The request's stages as plain functions over typed hand-offs.

process → prompt → encode → merge → prefill → decode. Each takes a :class:`~common.model.loader.LoadedModel` and
hand-off objects from :mod:`common.protocol.handoff`, and returns new ones; none keeps state between calls, so the
Ray deployments (and the offline batch job) can run any stage in any process. :mod:`common.reference.pipeline` chains
them in one process.
"""
