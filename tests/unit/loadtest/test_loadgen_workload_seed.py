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
