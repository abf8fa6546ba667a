"""Metrics recorded in a Serve proxy actor (the proxy guard's): ``prism_requests_total{deployment="proxy"}`` for each
refusal, and the front door's admission decisions (stage ``front``: :class:`common.admission.record.AdmissionRecorder`
writes them through :class:`ProxySink`).

A proxy is no Serve replica, so Serve adds no labels of its own: every series gets ``application=""``,
``deployment="proxy"`` and ``replica`` = the node's id (one proxy per node), beside the ingress's series that Ray's
metrics agent exports the same way. Recording never fails a request: a metrics error is swallowed.
"""

from __future__ import annotations

from typing import Any

from common.obs.catalogue import BY_NAME, SERVE_TAGS

_made: dict[str, Any] = {}


def _metric(name: str) -> Any:
    from ray.util.metrics import Counter, Histogram

    if name not in _made:
        spec = BY_NAME[name]
        keys = (*SERVE_TAGS, *spec.tags)
        if spec.kind == "counter":
            _made[name] = Counter(spec.name, description=spec.description, tag_keys=keys)
        else:
            buckets = list(spec.buckets)
            _made[name] = Histogram(spec.name, description=spec.description, boundaries=buckets, tag_keys=keys)
    return _made[name]


def _serve_tags() -> dict[str, str]:
    import ray

    if not ray.is_initialized():  # (not in a Ray worker: nowhere to record, and asking would start a Ray instance)
        raise RuntimeError("no Ray worker")
    return {"application": "", "deployment": "proxy", "replica": ray.get_runtime_context().get_node_id()[:12]}


class ProxySink:
    """A :class:`common.admission.record.MetricSink` in the proxy actor; ``application``: the label its series get
    (the front door's decisions are an application's: its dashboard shows them)."""

    def __init__(self, application: str = "") -> None:
        self.application = application

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        try:
            tags = {**_serve_tags(), "application": self.application, **tags}
            _metric(name).inc(value, tags=tags)
        except Exception:  # metrics must never turn a decision into a failure
            pass

    def observe(self, name: str, value: float, **tags: str) -> None:
        try:
            tags = {**_serve_tags(), "application": self.application, **tags}
            _metric(name).observe(value, tags=tags)
        except Exception:
            pass


def count_refusal(status: int, code: str) -> None:
    """``prism_requests_total{protocol="http", status, code, deployment="proxy"}``."""
    ProxySink().inc("prism_requests_total", protocol="http", status=str(status), code=code)
