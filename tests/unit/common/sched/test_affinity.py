"""Cache-affinity keys and the bounded-load replica choice (common.sched.affinity), in-process."""

from __future__ import annotations

import random

import pytest

from common.sched.affinity import AffinityTable, bound, media_key, prefix_key, rendezvous

PLACEHOLDER = frozenset({32000})
REPLICAS = ["r-a", "r-b"]


def _prompt(question: list[int], system: list[int] = (1, 2, 3)) -> list[int]:
    return [*system, 32000, 10, *question, 99]


def test_same_image_new_question_keeps_the_prefix_key_and_a_new_image_or_tenant_does_not():
    img, other = media_key("t", "data:image/png;base64,AAAA"), media_key("t", "data:image/png;base64,BBBB")
    first = prefix_key("t", _prompt([5, 6, 7]), PLACEHOLDER, [img], 32)
    assert prefix_key("t", _prompt([8, 9]), PLACEHOLDER, [img], 32) == first, "a new question: the same replica"
    assert prefix_key("t", _prompt([5, 6, 7]), PLACEHOLDER, [other], 32) != first, "the same text, another image"
    assert prefix_key("u", _prompt([5, 6, 7]), PLACEHOLDER, [img], 32) != first, "another tenant's scope"
    assert prefix_key("t", _prompt([5, 6, 7], system=(1, 2, 4)), PLACEHOLDER, [img], 32) != first
    assert media_key("u", "data:image/png;base64,AAAA") != img


def test_text_only_prompts_are_keyed_by_their_first_tokens():
    base = list(range(100, 140))
    assert prefix_key("t", [*base, 1, 2], PLACEHOLDER, [], 32) == prefix_key("t", [*base, 3], PLACEHOLDER, [], 32)
    assert prefix_key("t", base, PLACEHOLDER, [], 32) != prefix_key("t", [7, *base], PLACEHOLDER, [], 32)


def test_a_large_data_url_is_keyed_by_a_sample_of_its_bytes():
    head, tail = "data:image/jpeg;base64," + "A" * 70_000, "B" * 70_000
    assert media_key("t", head + "x" * 10 + tail) != media_key("t", head + "x" * 11 + tail)  # the length counts
    assert media_key("t", head + "x" * 10 + tail) == media_key("t", head + "y" * 10 + tail)  # (affinity only)
    assert media_key("t", "https://example.com/a.png") != media_key("t", "https://example.com/b.png")


def test_rendezvous_order_is_stable_and_a_leaving_replica_moves_only_its_keys():
    replicas = [f"r{i}" for i in range(4)]
    keys = [f"k{i}" for i in range(400)]
    owners = {k: rendezvous(k, replicas)[0] for k in keys}
    assert owners == {k: rendezvous(k, list(reversed(replicas)))[0] for k in keys}
    left = [r for r in replicas if r != "r2"]
    for k in keys:
        if owners[k] != "r2":
            assert rendezvous(k, left)[0] == owners[k]
    assert min(list(owners.values()).count(r) for r in replicas) > 60


def test_repeated_keys_always_go_to_their_replica():
    table = AffinityTable()
    images = [f"img{i}" for i in range(5)]
    first = {}
    rng = random.Random(3)
    for _ in range(8):
        rng.shuffle(images)
        for key in images:
            order, outcome = table.choose(key, REPLICAS)
            assert outcome == ("owner" if key in first else "new")
            table.routed(key, order[0], place=outcome in ("new", "moved"))
            table.completed(order[0])
            assert first.setdefault(key, order[0]) == order[0]
    assert all(table.owner(k) == r for k, r in first.items())


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("seed", range(5))
def test_a_mix_of_distinct_keys_spreads_evenly_however_the_hashes_fall(replicas, seed):
    names = [f"rep-{seed}-{i}" for i in range(replicas)]
    table = AffinityTable(load_factor=1.25)
    counts = dict.fromkeys(names, 0)
    for i in range(24 * replicas):
        order, outcome = table.choose(f"s{seed}-image-{i}", names)
        assert outcome == "new"
        table.routed(f"s{seed}-image-{i}", order[0], place=True)
        table.completed(order[0])
        counts[order[0]] += 1
    assert max(counts.values()) <= 1.5 * min(counts.values()), counts


def test_an_owner_over_its_share_of_in_flight_work_spills_and_keeps_its_keys():
    table = AffinityTable(load_factor=1.25)
    order, _ = table.choose("hot", REPLICAS)
    owner, other = order[0], order[1]
    table.routed("hot", owner, place=True)  # one in flight at the owner
    order, outcome = table.choose("hot", REPLICAS)
    assert outcome == "owner" and order[0] == owner  # 2 ≤ ceil(1.25 × 2 / 2) = 2
    table.routed("hot", owner, place=False)
    order, outcome = table.choose("hot", REPLICAS)  # 3 > ceil(1.25 × 3 / 2) = 2
    assert outcome == "spilled" and order == [other, owner]
    table.routed("hot", other, place=False)
    assert table.owner("hot") == owner
    for _ in range(3):
        table.completed(owner)
    assert table.choose("hot", REPLICAS) == ([owner, other], "owner")


def test_a_key_whose_replica_left_is_placed_again():
    table = AffinityTable()
    order, _ = table.choose("k", ["x", "y"])
    table.routed("k", order[0], place=True)
    table.completed(order[0])
    table.forget(order[0])
    left = [r for r in ["x", "y"] if r != order[0]]
    new_order, outcome = table.choose("k", left)
    assert outcome == "moved" and new_order == left
    table.routed("k", left[0], place=True)
    assert table.owner("k") == left[0]
    assert table.choose(None, ["x", "y"])[1] == "none"


def test_bound_and_capacity():
    assert bound(1.25, 0, 2) == 1 and bound(1.25, 3, 2) == 3 and bound(1.0, 7, 4) == 2
    table = AffinityTable(capacity=3)
    for i in range(5):
        table.routed(f"k{i}", "x", place=True)
    assert [table.owner(f"k{i}") for i in range(5)] == [None, None, "x", "x", "x"]
    with pytest.raises(ValueError):
        AffinityTable(load_factor=0.5)


def test_an_image_after_a_long_system_prompt_still_keys_the_prefix():
    """The cut-off of ``prefix_key_tokens`` is for text-only prompts: a first image 40 tokens in still counts."""
    system = tuple(range(200, 240))
    img, other = media_key("t", "data:a"), media_key("t", "data:b")
    first = prefix_key("t", _prompt([5, 6], system=system), PLACEHOLDER, [img], 32)
    assert prefix_key("t", _prompt([9], system=system), PLACEHOLDER, [img], 32) == first
    assert prefix_key("t", _prompt([5, 6], system=system), PLACEHOLDER, [other], 32) != first
