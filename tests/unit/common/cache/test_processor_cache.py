"""Processor cache: keyed by content digest (not URL), tenant-scoped, bounded by bytes; a hit equals a recompute."""

from __future__ import annotations

import numpy as np
import pytest

from common.cache.lru import ByteLRU
from common.cache.processor_cache import ProcessorCache
from common.config.media import MediaConfig
from common.media.fetch import MediaFetcher
from common.media.loader import load_media
from common.media.synthetic import synthetic_image
from common.protocol.handoff import MediaRef
from common.stages.process import process_images
from tests.mediakit import MediaServer, Route, png_bytes

CFG = MediaConfig(allowed_private_networks=("127.0.0.1/32",))
FETCHER = MediaFetcher(CFG)


def _process(lm, cache, url, tenant="t1", options=None):
    media = load_media([MediaRef("image", url)], CFG, FETCHER)
    return process_images(
        lm, [m.image for m in media], [m.digest for m in media], cache=cache, tenant=tenant, options=options
    )[0]


@pytest.fixture
def server():
    with MediaServer() as s:
        s.routes["/a.png"] = Route(body=png_bytes(synthetic_image(300, 200, seed=1)))
        s.routes["/b.png"] = Route(body=png_bytes(synthetic_image(300, 200, seed=1)))  # same bytes, other URL
        yield s


def test_same_bytes_under_two_urls_hit_and_equal_recompute(tiny_model, server):
    cache = ProcessorCache(max_bytes=64 << 20)
    a = _process(tiny_model, cache, server.url("/a.png"))
    b = _process(tiny_model, cache, server.url("/b.png"))
    s = cache.stats()
    assert (s.hits, s.misses, s.entries) == (1, 1, 1)
    fresh = _process(tiny_model, None, server.url("/b.png"))
    np.testing.assert_array_equal(b.pixel_values, fresh.pixel_values)
    assert a.media_digest == b.media_digest and b.grid_thw == fresh.grid_thw
    assert not b.pixel_values.flags.writeable, "cached arrays are shared and must be read-only"


def test_same_url_with_new_bytes_misses(tiny_model, server):
    cache = ProcessorCache(max_bytes=64 << 20)
    first = _process(tiny_model, cache, server.url("/a.png"))
    server.routes["/a.png"] = Route(body=png_bytes(synthetic_image(300, 200, seed=2)))
    second = _process(tiny_model, cache, server.url("/a.png"))
    assert cache.stats().hits == 0 and cache.stats().misses == 2
    assert first.media_digest != second.media_digest
    assert not np.array_equal(first.pixel_values, second.pixel_values)


def test_other_tenant_and_other_options_miss(tiny_model, server):
    cache = ProcessorCache(max_bytes=64 << 20)
    _process(tiny_model, cache, server.url("/a.png"), tenant="t1")
    _process(tiny_model, cache, server.url("/a.png"), tenant="t2")
    _process(tiny_model, cache, server.url("/a.png"), tenant="t1", options={"background": [0, 0, 0]})
    assert cache.stats().hits == 0 and cache.stats().entries == 3
    shared = ProcessorCache(max_bytes=64 << 20, shared_across_tenants=True)
    _process(tiny_model, shared, server.url("/a.png"), tenant="t1")
    _process(tiny_model, shared, server.url("/a.png"), tenant="t2")
    assert shared.stats().hits == 1


def test_eviction_honours_the_byte_budget(tiny_llava):
    images = [synthetic_image(100, 100, seed=i) for i in range(3)]
    one = process_images(tiny_llava, images[:1])[0].pixel_values.nbytes
    cache = ProcessorCache(max_bytes=2 * one + one // 2)
    for img in images:
        process_images(tiny_llava, [img], cache=cache)
    s = cache.stats()
    assert s.entries == 2 and s.evictions == 1 and s.bytes <= cache._lru.max_bytes
    process_images(tiny_llava, [images[0]], cache=cache)  # the evicted (least recent) one misses again
    process_images(tiny_llava, [images[2]], cache=cache)  # the most recent one hits
    s = cache.stats()
    assert s.hits == 1 and s.misses == 4


def test_lru_by_bytes_not_count():
    lru: ByteLRU[str] = ByteLRU(max_bytes=100)
    for i in range(10):
        lru.put(f"small{i}", "x", 5)
    assert len(lru) == 10
    assert lru.put("big", "y", 80)
    assert lru.stats().bytes <= 100 and lru.get("big") == "y" and lru.get("small0") is None
    assert not lru.put("huge", "z", 101) and lru.get("huge") is None
