"""Shadow policies: each decides in a world of its own modelled caches, sharing only the live load (no
sockets)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dpserve.kvindex.index import block_keys
from dpserve.kvindex.modelled import ModelledCaches, cacheable_blocks
from dpserve.policies import make_policy
from dpserve.policies.base import PrefixMatch, PrefixSource, ReplicaSnapshot, RequestFeatures
from dpserve.router.quality.prefill_cost import PrefillCost
from dpserve.router.quality.shadows import ShadowCollector, ShadowScorer

BS = 4


def request(group: int, index: int) -> RequestFeatures:
    """A prompt of 21 tokens: 4 blocks shared by its group, 1 of its own, and a last token."""
    tokens = [1000 * (group + 1) + t for t in range(16)] + [7 * index + t for t in range(4)] + [99]
    keys = block_keys(tokens, BS)
    prefix = PrefixMatch(PrefixSource.KV_EVENTS, len(keys), BS, keys=tuple(keys), prompt_tokens=len(tokens))
    return RequestFeatures("completions", "m", False, prefix=prefix)


def test_modelled_caches_are_lru_per_replica() -> None:
    caches = ModelledCaches()
    caches.add("r0", [1, 2, 3], capacity=4)
    assert (caches.leading("r0", [1, 2, 9]), caches.leading("r1", [1]), caches.blocks("r0")) == (2, 0, 3)
    caches.add("r0", [1, 5], capacity=4)  # 1 used again; 3, the first prompt's tail, is the least recent
    caches.add("r0", [6], capacity=4)
    assert caches.leading("r0", [1, 2]) == 2 and caches.leading("r0", [3]) == 0 and caches.blocks("r0") == 4
    caches.add("r1", list(range(100)), capacity=0)  # unknown capacity: unbounded
    assert caches.blocks("r1") == 100
    # A prompt's blocks are used last block first, as vLLM frees them: its front is evicted last.
    caches.add("r2", [1, 2, 3], capacity=3)
    caches.add("r2", [1, 8], capacity=3)  # the tail of [1, 2, 3] goes, its front (1) stays
    assert caches.leading("r2", [1, 2]) == 2 and caches.leading("r2", [3]) == 0
    assert cacheable_blocks(5, 21, BS) == 5 and cacheable_blocks(5, 20, BS) == 4  # the last token's block


class FirstDraw(random.Random):
    """A turn policy's cache model always draws the first candidate: its estimate, checkable by hand."""

    def choice(self, seq):  # type: ignore[no-untyped-def]
        return seq[0]


def run(capacity: int, others: tuple[int, int] = (0, 0)) -> dict[str, dict]:  # type: ignore[type-arg]
    """Live: a perfect partition (group 0 on r0, group 1 on r1). Requests A A B B, twice, one at a time.
    `others`: requests on each replica that are no router's (other clients)."""
    scorer = ShadowScorer(
        [make_policy("round_robin"), make_policy("least_loaded"), make_policy("kv_aware")],
        lambda _: capacity,
        FirstDraw(),
    )
    candidates = [ReplicaSnapshot("r0", running=others[0]), ReplicaSnapshot("r1", running=others[1])]
    for index, group in enumerate([0, 0, 1, 1, 0, 0, 1, 1]):
        scorer.observe(request(group, index), candidates, f"r{group}").release()
    status = scorer.status()
    return {"live": status["live_modelled"], **status["shadows"]}


def test_each_shadow_is_scored_on_the_caches_its_own_choices_would_have_made() -> None:
    prompt = 8 * 21
    roomy = run(capacity=0, others=(0, 3))
    # Live: each group computes its 4 shared blocks once; 6 repeats hit them (24 blocks).
    assert roomy["live"]["estimated_cached_tokens"] == 24 * BS and roomy["live"]["prompt_tokens"] == prompt
    # Least loaded (r1 is busy with other clients' requests): everything on r0, as many hits as the partition.
    assert roomy["least_loaded"]["by_replica"] == {"r0": 8} and roomy["least_loaded"]["estimated_cached_tokens"] == 96
    # All 8 on one of 2 replicas: twice the fair share.
    assert roomy["least_loaded"]["mean_load"] == 0 and roomy["least_loaded"]["max_share"] == 2.0
    # Round robin's decisions are its counter's (even, half agreeing with the partition); its cache model
    # drew r0 every time, so r0 would hit what least loaded hits, r1 nothing: the mean over both is half.
    assert roomy["round_robin"]["max_share"] == 1.0 and roomy["round_robin"]["agreed"] == 4
    assert roomy["round_robin"]["estimated_cached_tokens"] == 96 // 2
    # kv_aware decides on its own modelled caches: a group stays where its blocks are.
    assert roomy["kv_aware"]["estimated_cached_tokens"] == 24 * BS
    # Caches of 6 blocks: one group's prompt (5 blocks) fits a replica, two do not.
    tight = run(capacity=6, others=(0, 3))
    assert tight["live"]["estimated_cached_tokens"] == 24 * BS  # a partition still fits
    assert tight["least_loaded"]["estimated_cached_tokens"] < 24 * BS  # both groups on r0: they evict each other
    assert tight["live"]["estimated_hit_rate"] == pytest.approx(96 / prompt)


def test_a_shadow_sees_the_load_its_own_choices_make_not_the_live_policys() -> None:
    scorer = ShadowScorer([make_policy("least_loaded")], lambda _: 0)
    # Both idle: the shadow's first request goes to either, and is in flight there in its world.
    first = scorer.observe(request(0, 0), [ReplicaSnapshot("r0"), ReplicaSnapshot("r1")], "r1")
    (own, held), *rest = scorer.shadows[0].in_flight.items()
    assert held == 1 and not rest
    other = "r1" if own == "r0" else "r0"
    live_busy = [ReplicaSnapshot(own), ReplicaSnapshot(other, in_flight=5)]  # live: the shadow's other is busy
    second = scorer.observe(request(0, 1), live_busy, own)
    assert scorer.shadows[0].in_flight == {own: 1, other: 1}  # it went where its own world was idle
    # Requests of other clients count in its world too; each hold, once released, frees its slot.
    first.release()
    first.release()  # idempotent: an adapter's attempt may end twice
    assert scorer.shadows[0].in_flight == {other: 1}
    third = scorer.observe(request(0, 2), [ReplicaSnapshot(own, running=2), ReplicaSnapshot(other)], own)
    assert scorer.shadows[0].in_flight == {other: 2}  # own: 0 of its own + 2 others'; other: 1 of its own
    second.release()
    third.release()
    assert scorer.shadows[0].in_flight == {}
    assert scorer.status()["shadows"]["least_loaded"]["mean_load"] == pytest.approx((0 + 0 + 1) / 3)


def test_round_robin_is_not_pinned_by_arrivals_in_lockstep() -> None:
    """4 conversations x 6 turns on 2 replicas, arriving c0 c1 c2 c3 each turn: the counter puts every
    conversation on one replica, as the live partition does, only because the arrivals keep step with it.
    Its estimate is what the turn gives when they do not: about half of each turn's history."""
    scorer = ShadowScorer([make_policy("round_robin")], lambda _: 0, random.Random(7))
    histories = {c: [1000 * (c + 1) + t for t in range(8)] for c in range(4)}
    for turn in range(6):
        for c in range(4):
            histories[c] += [100 * turn + 10 * c + t for t in range(8)]
            tokens = [*histories[c], 99]
            keys = block_keys(tokens, BS)
            prefix = PrefixMatch(PrefixSource.KV_EVENTS, len(keys), BS, keys=tuple(keys), prompt_tokens=len(tokens))
            features = RequestFeatures("completions", "m", False, prefix=prefix)
            scorer.observe(features, [ReplicaSnapshot("r0"), ReplicaSnapshot("r1")], f"r{c % 2}").release()
    status = scorer.status()
    pinned = status["live_modelled"]["estimated_hit_rate"]
    turn = status["shadows"]["round_robin"]
    assert turn["by_replica"] == {"r0": 12, "r1": 12} and turn["agreed"] == 24  # the counter did pin them
    assert 0.35 * pinned < turn["estimated_hit_rate"] < 0.8 * pinned


def test_only_load_and_kv_policies_can_be_shadows_and_the_counts_are_metrics() -> None:
    for name in ("prefix", "session"):
        with pytest.raises(ValueError, match=f"--shadow-policy {name}"):
            ShadowScorer([make_policy(name)], lambda _: 0)
    scorer = ShadowScorer([make_policy("round_robin")], lambda _: 0)
    scorer.observe(request(0, 0), [ReplicaSnapshot("r0"), ReplicaSnapshot("r1")], "r1")
    scorer.observe(RequestFeatures("embeddings", "m", False), [ReplicaSnapshot("r0")], "r0")  # no prompt blocks
    registry = CollectorRegistry()
    registry.register(ShadowCollector(scorer))
    text = generate_latest(registry).decode()
    assert 'dpserve_shadow_decisions_total{policy="round_robin",replica="r0"} 2.0' in text
    assert 'dpserve_shadow_decisions_total{policy="live",replica="r1"} 1.0' in text
    assert 'dpserve_shadow_tokens_total{kind="prompt",policy="round_robin"} 21.0' in text
    assert 'dpserve_shadow_agreed_total{policy="round_robin"} 1.0' in text  # the second, on one candidate


def test_the_prefill_cost_is_the_slope_of_time_against_computed_tokens() -> None:
    cost = PrefillCost(half_life=64)
    assert cost.seconds_per_token == 0.0  # nothing seen
    for tokens in [10, 500, 40, 1200, 80, 900] * 5:
        cost.learn(tokens, 0.05 + 0.0001 * tokens)
    assert cost.seconds_per_token == pytest.approx(0.0001)
    flat = PrefillCost()
    for _ in range(10):
        flat.learn(300, 0.2)
    assert flat.seconds_per_token == 0.0  # one prompt length says nothing about the slope
    backwards = PrefillCost()
    for tokens in [10, 500, 40, 1200]:
        backwards.learn(tokens, 1.0 - 0.0001 * tokens)
    assert backwards.seconds_per_token == 0.0  # never a negative cost


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_shadow_choice_that_would_compute_more_is_held_that_much_longer() -> None:
    clock = Clock()
    scorer = ShadowScorer([make_policy("least_loaded")], lambda _: 0, clock=clock)
    shadow = scorer.shadows[0]
    for tokens in [100, 1000] * 20:  # about 0.1 ms a computed token, as the live requests' times show
        scorer.prefill.learn(tokens, 0.01 + 0.0001 * tokens)
    # Live: group 0 twice on r1 (the second hits 4 blocks). The shadow puts the first on r0 (r1 has other
    # clients' requests); both compute the whole prompt, so the shadow's ends with the live one.
    first = scorer.observe(request(0, 0), [ReplicaSnapshot("r0"), ReplicaSnapshot("r1", running=1)], "r1")
    clock.now = 0.01
    first.release()
    assert shadow.in_flight == {}
    # The second: r0 is busy now, so the shadow takes r1, where its world holds nothing: 16 tokens more to
    # compute than the live request, which hit.
    second = scorer.observe(request(0, 1), [ReplicaSnapshot("r0", running=5), ReplicaSnapshot("r1")], "r1")
    clock.now = 0.02
    second.release()
    per_token = scorer.prefill.seconds_per_token
    assert per_token == pytest.approx(0.0001, rel=0.2)
    assert shadow.in_flight == {"r1": 1}  # held past the live request's end
    no_prompt = RequestFeatures("embeddings", "m", False)
    clock.now = 0.02 + 16 * per_token - 1e-6
    scorer.observe(no_prompt, [ReplicaSnapshot("r0", running=5), ReplicaSnapshot("r1", running=5)], "r0").release()
    assert shadow.in_flight == {"r1": 1}
    clock.now = 0.02 + 16 * per_token + 1e-6
    scorer.observe(no_prompt, [ReplicaSnapshot("r0", running=5), ReplicaSnapshot("r1", running=5)], "r0").release()
    assert shadow.in_flight == {}
    assert scorer.status()["prefill_ms_per_token"] == pytest.approx(per_token * 1000, abs=1e-6)
