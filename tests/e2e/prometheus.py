"""Scraping the Ray metrics endpoint in tests: samples by name and labels, and waiting for a condition on them."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, dict[str, str], float]


def scrape(url: str) -> list[Sample]:
    text = httpx.get(url, timeout=10).text
    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def settled(url: str, quiet_s: float = 2.5) -> list[Sample]:
    """A scrape that includes everything recorded before this call: Ray exports every second, so a baseline read
    right after earlier traffic could miss its last increments and make a later delta look too large."""
    time.sleep(quiet_s)
    return scrape(url)


def wait_for(url: str, predicate: Callable[[list[Sample]], bool], timeout: float = 30.0) -> list[Sample]:
    """Scrape until ``predicate`` holds (Ray exports every second in the test cluster); the last scrape either way. A
    scrape the agent refuses is retried until ``timeout``."""
    end = time.time() + timeout
    while True:
        try:
            samples = scrape(url)
        except httpx.TransportError:  # (Ray's metrics agent, a process of its own, refused a scrape once in CI)
            if time.time() > end:
                raise
            time.sleep(0.5)
            continue
        if predicate(samples) or time.time() > end:
            return samples
        time.sleep(0.5)
