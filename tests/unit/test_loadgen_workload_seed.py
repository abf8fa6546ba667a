"""Each workload seed has its own hot images: a benchmark run with a new seed starts from cold caches."""

from __future__ import annotations

from loadtest.workload import OutputLengths, Workload


def _urls(seed: int) -> set[str]:
    w = Workload(mix={"image": 1}, sizes={"small": 1}, cache="hot", outputs=OutputLengths("fixed:4"), seed=seed)
    return {w.next_request("m")[1]["messages"][0]["content"][0]["image_url"]["url"] for _ in range(5)}


def test_hot_images_repeat_within_a_seed_and_differ_across_seeds():
    a, b = _urls(1), _urls(2)
    assert len(a) == 1 and len(b) == 1 and a != b
