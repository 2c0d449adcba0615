"""Decisions in a large fleet: a window of the replicas (plus the likely cache holders) for load and cache
policies, the next in turn for round robin, and the whole fleet whenever the sample has no room."""

from __future__ import annotations

import dataclasses
from collections import Counter

from dpserve.kvindex.events import BlockStored
from dpserve.kvindex.index import KvIndex, block_keys
from dpserve.policies import PrefixMatch, PrefixSource, RequestFeatures
from dpserve.policies.session import SessionAffinity
from dpserve.replicas.health import Outcome
from tests.unit.selection_fixtures import MODEL, REQUEST, fleet, selector


def test_least_loaded_picks_the_least_loaded_of_a_window_and_spreads_over_the_fleet() -> None:
    registry, catalog = fleet(64)
    for index, replica in enumerate(registry):
        replica.in_flight = index % 5 + 1
    router = selector(registry, catalog, "least_loaded")
    chosen = Counter()
    for _ in range(2000):
        decision = router.decide(REQUEST)
        assert decision is not None
        chosen[decision.id] += 1
    loads = {replica.id: replica.in_flight for replica in registry}
    # A window of 8 consecutive replicas always holds a load-1 one: only those are ever chosen.
    assert {loads[rid] for rid in chosen} == {1}
    assert len(chosen) == sum(1 for load in loads.values() if load == 1)


def test_with_the_sample_off_the_whole_fleet_is_weighed() -> None:
    registry, catalog = fleet(64)
    for replica in registry:
        replica.in_flight = 3
    registry.get("r40").in_flight = 0
    assert {selector(registry, catalog, "least_loaded", sample=0).decide(REQUEST).id for _ in range(50)} == {"r40"}
    # With a window of 8, the idle replica is chosen only when the window holds it.
    sampled = selector(registry, catalog, "least_loaded")
    assert len({sampled.decide(REQUEST).id for _ in range(50)}) > 1


def test_a_full_sample_falls_back_to_the_whole_fleet() -> None:
    registry, catalog = fleet(32)
    for replica in registry:
        replica.in_flight = 4  # the admission limit: no room
    registry.get("r17").in_flight = 0
    router = selector(registry, catalog, "least_loaded", limit=4)
    assert all(router.decide(REQUEST).id == "r17" for _ in range(20))
    registry.get("r17").in_flight = 4
    assert router.decide(REQUEST) is None


def test_round_robin_takes_every_replica_in_turn() -> None:
    registry, catalog = fleet(40)
    router = selector(registry, catalog, "round_robin")
    chosen = [router.decide(REQUEST).id for _ in range(80)]
    assert Counter(chosen) == Counter({replica.id: 2 for replica in registry})
    assert chosen[:40] == chosen[40:]
    registry.set_draining(chosen[0], True)
    assert chosen[0] not in {router.decide(REQUEST).id for _ in range(80)}


def test_the_replicas_holding_the_prefix_join_the_window() -> None:
    registry, catalog = fleet(64)
    for replica in registry:
        replica.block_size = 4
    index = KvIndex()
    prompt = list(range(64))
    index.store("r33", BlockStored(tuple(range(16)), None, tuple(prompt), 4))
    keys = tuple(block_keys(prompt, 4))
    request = RequestFeatures("completions", MODEL, False, PrefixMatch(PrefixSource.KV_EVENTS, len(keys), 4, keys=keys))
    router = selector(registry, catalog, "kv_aware", kv_index=index)
    assert all(router.decide(request).id == "r33" for _ in range(30))


def test_the_routable_view_follows_health_draining_and_models() -> None:
    registry, catalog = fleet(3)
    ids = lambda: [replica.id for replica in catalog.routable(MODEL)]  # noqa: E731
    assert ids() == ["r0", "r1", "r2"]
    registry.set_draining("r1", True)
    assert ids() == ["r0", "r2"]
    registry.observe("r0", Outcome.REFUSED)
    assert ids() == ["r2"]
    catalog.set_model_cards("r2", ({"id": "other"},))
    assert ids() == [] and catalog.served_models() == ["other"] and catalog.only_model() == "other"
    registry.set_draining("r1", False)
    assert ids() == ["r1"] and catalog.serves(MODEL)
    registry.add("http://127.0.0.1:39999")
    registry.remove("r1")
    assert ids() == [] and not catalog.serves(MODEL)


def test_a_sample_of_replicas_backing_off_gives_way_to_the_rest_of_the_fleet() -> None:
    registry, catalog = fleet(12)
    for replica in registry:
        if replica.id != "r5":
            registry.observe(replica.id, Outcome.BACKPRESSURE)  # answered 429: avoided while another has room
    for policy_name in ("round_robin", "least_loaded"):
        router = selector(registry, catalog, policy_name)
        assert {router.decide(REQUEST).id for _ in range(24)} == {"r5"}


def test_a_session_keeps_its_replica_on_the_whole_fleets_ring_while_deciding_among_a_sample() -> None:
    registry, catalog = fleet(40)
    router = selector(registry, catalog, "session")
    policy = router.policy
    assert isinstance(policy, SessionAffinity)
    ring_order = list(policy.ring(tuple(sorted(r.id for r in registry))).walk("user-7"))
    request = RequestFeatures("chat", MODEL, False, session_key="user-7")
    assert {router.decide(request).id for _ in range(50)} == {ring_order[0]}
    # Its replica over the load bound: the next on the ring takes the key, still whatever the sample.
    registry.get(ring_order[0]).in_flight = 50
    assert {router.decide(request).id for _ in range(50)} == {ring_order[1]}
    # Other keys spread over the fleet.
    keys = {router.decide(RequestFeatures("chat", MODEL, False, session_key=f"k{i}")).id for i in range(200)}
    assert len(keys) > 30


def test_the_features_copies_are_dataclass_replace() -> None:
    # The hot path copies with compiled methods instead of `dataclasses.replace`: the same copies (the
    # dataclass's eq compares every field, so a field forgotten in `_copy` fails here).
    prefix = PrefixMatch(PrefixSource.KV_EVENTS, 4, 16, {"a": 1}, (1, 2, 3, 4), {"a": 9}, 64)
    features = RequestFeatures("chat", "m", True, prefix, "s", ("a",), "b", 0, "lora")
    assert features.with_prefix(None) == dataclasses.replace(features, prefix=None)
    assert features.with_preferred(("x",)) == dataclasses.replace(features, preferred=("x",))
    assert features.with_priority(2) == dataclasses.replace(features, priority=2)
    assert prefix.with_matches({"b": 2}) == dataclasses.replace(prefix, matched={"b": 2})
    assert prefix.with_matches({"b": 2}, {"b": 3}) == dataclasses.replace(prefix, matched={"b": 2}, held={"b": 3})
    assert features.with_priority(2) is not features and features.priority == 0
