"""Each workload seed has its own hot images: a benchmark run with a new seed starts from cold caches."""

from __future__ import annotations

from loadtest.workload import OutputLengths, Workload


def _urls(seed: int) -> set[str]:
    w = Workload(mix={"image": 1}, sizes={"small": 1}, cache="hot", outputs=OutputLengths("fixed:4"), seed=seed)
    return {w.next_request("m")[1]["messages"][0]["content"][0]["image_url"]["url"] for _ in range(5)}


def test_hot_images_repeat_within_a_seed_and_differ_across_seeds():
    a, b = _urls(1), _urls(2)
    assert len(a) == 1 and len(b) == 1 and a != b


def test_a_hot_set_of_several_images_asked_new_questions():
    """The cache-reach bench's hot load: a few images of the seed's own, drawn at random, each question new."""
    from loadtest.bench_cache import hot_workload
    from loadtest.bench_loads import seed_of

    w = hot_workload(seed_of("cache_hot"))
    bodies = [w.next_request("m")[1] for _ in range(40)]
    urls = [b["messages"][0]["content"][0]["image_url"]["url"] for b in bodies]
    questions = [b["messages"][0]["content"][1]["text"] for b in bodies]
    assert set(urls) == set(w.hot_set("medium")) and len(set(urls)) == 4
    assert len(set(questions)) == 40
    others = {u for i in range(1, 3) for u in hot_workload(seed_of("cache_hot", i)).hot_set("medium")}
    assert not others & set(urls), "another run's hot set starts cold"
    single = Workload(mix={"image": 1}, sizes={"medium": 1}, cache="hot", seed=seed_of("cache_hot"))
    assert not set(single.hot_set("medium")) & set(urls)


def test_a_planned_batch_is_the_same_requests_as_one_at_a_time_whoever_draws_the_images():
    """``next_requests`` draws the unique images on threads after the rest: the bodies, in order, and the workload's
    state after them are what single calls give (a plan must not depend on how it was built)."""

    def workload(cache: str) -> Workload:
        return Workload(
            mix={"text": 0.3, "image": 0.4, "multi_image": 0.3},
            sizes={"small": 0.7, "medium": 0.3},
            cache=cache,  # type: ignore[arg-type]
            outputs=OutputLengths("uniform:4-16"),
            seed=7,
        )

    for cache in ("cold", "hot", "partial"):
        batched, single = workload(cache), workload(cache)
        got = batched.next_requests("m", 12, threads=3) + batched.next_requests("m", 3, threads=1)
        assert got == [single.next_request("m") for _ in range(15)], cache
        assert batched.next_request("m") == single.next_request("m"), cache
    contents = [b["messages"][0]["content"] for _, b in got]
    urls = [p["image_url"]["url"] for c in contents if isinstance(c, list) for p in c if p["type"] == "image_url"]
    assert urls and all(u.startswith("data:image/jpeg;base64,") for u in urls)


def test_the_synthetic_image_is_the_same_pixels_as_its_plain_construction():
    """``synthetic_image`` builds its planes in place (it is drawn before every planned load): the pixels are the
    ones of stacking full-size gradient planes and adding the noise, shapes included."""
    import numpy as np
    from PIL import Image

    from common.media.synthetic import draw_shapes, synthetic_image

    def plain(width: int, height: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        blue = np.full_like(x, rng.integers(0, 256))
        base = np.stack([255 * (x / max(1, width - 1)), 255 * (y / max(1, height - 1)), blue], axis=-1)
        img = Image.fromarray(np.clip(base + rng.normal(0, 24, size=base.shape), 0, 255).astype(np.uint8), "RGB")
        return np.asarray(draw_shapes(img, rng))

    for (w, h), seed in [((224, 224), 0), ((640, 480), 5), ((1, 1), 3), ((3, 7), 2**40), ((97, 31), 123)]:
        assert np.array_equal(np.asarray(synthetic_image(w, h, seed)), plain(w, h, seed)), (w, h, seed)


def test_the_sweep_sends_one_sequence_at_every_rate_each_with_images_of_its_own():
    """The goodput sweep: the same arrivals (scaled by the rate) and the same requests at each rate — only the images
    differ, so each run starts cold and a higher rate is more of the same load, not another draw of it."""
    from loadtest.arrivals import arrival_times
    from loadtest.bench_loads import SWEEP_SEQUENCE, seed_of

    def sweep_workload(images: int) -> Workload:
        mix = {"text": 0.4, "image": 0.4, "multi_image": 0.2}
        return Workload(
            mix=mix, cache="partial", outputs=OutputLengths("uniform:8-32"), seed=SWEEP_SEQUENCE, image_seed=images
        )

    def shape(body: dict) -> tuple:
        content = body["messages"][0]["content"]
        parts = content if isinstance(content, list) else [content]
        return body["max_tokens"], tuple(
            "image" if isinstance(p, dict) and p["type"] == "image_url" else str(p) for p in parts
        )

    def urls(bodies: list) -> set[str]:
        return {
            p["image_url"]["url"]
            for b in bodies
            if isinstance(b["messages"][0]["content"], list)
            for p in b["messages"][0]["content"]
            if p["type"] == "image_url"
        }

    a = [b for _, b in sweep_workload(seed_of("sweep")).next_requests("m", 30, threads=1)]
    b = [b for _, b in sweep_workload(seed_of("sweep") + 1).next_requests("m", 30, threads=1)]
    assert [shape(x) for x in a] == [shape(x) for x in b]
    assert urls(a) and not urls(a) & urls(b)
    slow, fast = (
        arrival_times("poisson", 5.0, 20.0, SWEEP_SEQUENCE),
        arrival_times("poisson", 8.0, 20.0, SWEEP_SEQUENCE),
    )
    assert len(fast) > len(slow) and all(
        abs(s * 5.0 - f * 8.0) < 1e-9 for s, f in zip(slow, fast[: len(slow)], strict=True)
    )
    default = Workload(seed=7)
    assert default.next_request("m") == Workload(seed=7, image_seed=7).next_request(
        "m"
    )  # (image_seed defaults to seed)
