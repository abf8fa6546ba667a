"""Where the cache-affinity routers sent each call, for the request's trace: a small process-local record.

Why a module of its own: Ray Serve pickles a custom request router's module *by value* into every process that holds
a handle, so module state in :mod:`services.routers.affinity` would be a private copy the ingress's pipeline client
never sees. This module is pickled by reference: the router (in the ingress replica's process, on the handle's event
loop) writes here with :func:`keep`, the pipeline client (same process, its own loop) reads with :func:`take` once the
request's chain started. Bounded: decisions nobody takes (a failed attempt's) are dropped oldest first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

KEPT = 4096

_decisions: OrderedDict[tuple[str, str], dict[str, str]] = OrderedDict()
_lock = threading.Lock()


def keep(stage: str, attempt_key: str, decision: dict[str, str]) -> None:
    with _lock:
        _decisions[(stage, attempt_key)] = decision
        while len(_decisions) > KEPT:
            _decisions.popitem(last=False)


def take(stage: str, attempt_key: str) -> dict[str, str] | None:
    """The decision of one call (``outcome``, ``replica``), once."""
    with _lock:
        return _decisions.pop((stage, attempt_key), None)
