"""Shadow policies: each decides in a world of its own modelled caches, sharing only the live load (no
sockets)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dpserve.kvindex.index import block_keys
from dpserve.kvindex.modelled import ModelledCaches, cacheable_blocks
from dpserve.policies import make_policy
from dpserve.policies.base import PrefixMatch, PrefixSource, ReplicaSnapshot, RequestFeatures
from dpserve.router.shadows import ShadowCollector, ShadowScorer

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


def run(capacity: int, load: tuple[int, int] = (0, 0)) -> dict[str, dict]:  # type: ignore[type-arg]
    """Live: a perfect partition (group 0 on r0, group 1 on r1). Requests A A B B, twice."""
    scorer = ShadowScorer(
        [make_policy("round_robin"), make_policy("least_loaded"), make_policy("kv_aware")], lambda _: capacity
    )
    candidates = [ReplicaSnapshot("r0", in_flight=load[0]), ReplicaSnapshot("r1", in_flight=load[1])]
    for index, group in enumerate([0, 0, 1, 1, 0, 0, 1, 1]):
        scorer.observe(request(group, index), candidates, f"r{group}")
    status = scorer.status()
    return {"live": status["live_modelled"], **status["shadows"]}


def test_each_shadow_is_scored_on_the_caches_its_own_choices_would_have_made() -> None:
    prompt = 8 * 21
    roomy = run(capacity=0, load=(0, 3))
    # Live: each group computes its 4 shared blocks once; 6 repeats hit them (24 blocks).
    assert roomy["live"]["estimated_cached_tokens"] == 24 * BS and roomy["live"]["prompt_tokens"] == prompt
    # Round robin sends A to r0 then r1, B to r0 then r1: each group's first visit to each replica misses.
    assert roomy["round_robin"]["estimated_cached_tokens"] == 16 * BS and roomy["round_robin"]["agreed"] == 4
    # Least loaded (r0 is idle in this snapshot): everything on r0, as many hits as the partition.
    assert roomy["least_loaded"]["by_replica"] == {"r0": 8} and roomy["least_loaded"]["estimated_cached_tokens"] == 96
    # All 8 on one of 2 replicas: twice the fair share.
    assert roomy["least_loaded"]["mean_load"] == 0 and roomy["least_loaded"]["max_share"] == 2.0
    assert roomy["round_robin"]["max_share"] == 1.0
    # kv_aware decides on its own modelled caches: a group stays where its blocks are.
    assert roomy["kv_aware"]["estimated_cached_tokens"] == 24 * BS
    # Caches of 6 blocks: one group's prompt (5 blocks) fits a replica, two do not.
    tight = run(capacity=6, load=(0, 3))
    assert tight["live"]["estimated_cached_tokens"] == 24 * BS  # a partition still fits
    assert tight["least_loaded"]["estimated_cached_tokens"] < 24 * BS  # both groups on r0: they evict each other
    # Round robin alternates the groups on each replica: each evicts all but the other's first block (a
    # prompt's front is evicted last) before it comes back.
    assert tight["round_robin"]["estimated_cached_tokens"] == 4 * BS
    assert tight["live"]["estimated_hit_rate"] == pytest.approx(96 / prompt)


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
