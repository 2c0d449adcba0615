"""kv_aware, prefix and session: decisions from hand-made features and replica snapshots."""

from __future__ import annotations

import collections
import dataclasses
import random

import pytest

from dpserve.policies import PrefixMatch, PrefixSource, ReplicaSnapshot, RequestFeatures, make_policy
from dpserve.policies.balance import BalanceGuard
from dpserve.policies.kv_aware import KvAware, KvAwareWeights
from dpserve.policies.prefix import PrefixAffinity
from dpserve.policies.session import SessionAffinity


def kv_features(total: int, **matched: int) -> RequestFeatures:
    return RequestFeatures("chat", "m", False, PrefixMatch(PrefixSource.KV_EVENTS, total, 16, matched))


def text_features(total: int, **matched: int) -> RequestFeatures:
    return RequestFeatures("chat", "m", False, PrefixMatch(PrefixSource.ROUTED_TEXT, total, 16, matched))


def replicas(*loads: int, kv: tuple[float, ...] = ()) -> list[ReplicaSnapshot]:
    return [ReplicaSnapshot(f"r{i}", in_flight=load, kv_usage=kv[i] if kv else 0.0) for i, load in enumerate(loads)]


def test_kv_aware_goes_where_the_prompt_is_cached() -> None:
    policy = KvAware(random.Random(0))
    decision = policy.choose(kv_features(10, r1=8), replicas(0, 2, 0))
    assert (decision.id, decision.reason) == ("r1", "cache_hit")


def test_kv_aware_weighs_cache_against_load_by_its_formula() -> None:
    policy = KvAware(random.Random(0), KvAwareWeights(load_weight=0.1, kv_weight=0.0))
    # r0: 1 - 8/10 + 0.1 * 3 = 0.5; r1: 1 + 0.1 * 0 = 1.0 -> the cache wins.
    assert policy.choose(kv_features(10, r0=8), replicas(3, 0)).id == "r0"
    # r0 with 9 in flight: 0.2 + 0.9 = 1.1 > 1.0 -> load wins, and says so.
    decision = KvAware(random.Random(0), KvAwareWeights(0.1, 0.0), BalanceGuard(10, 100)).choose(
        kv_features(10, r0=8), replicas(9, 0)
    )
    assert (decision.id, decision.reason) == ("r1", "load")
    assert policy.cost(kv_features(10, r0=8), replicas(3, 0)[0]) == pytest.approx(0.5)


def test_kv_aware_settles_a_new_prefix_where_the_least_is_cached() -> None:
    policy = KvAware(random.Random(0))

    def features(**matched: int) -> RequestFeatures:
        held = {"r0": 500, "r1": 300, "r2": 100}
        return RequestFeatures("chat", "m", False, PrefixMatch(PrefixSource.KV_EVENTS, 10, 16, matched, (), held))

    # Nothing cached anywhere, equal load: the replica owning the least of the fleet's cache.
    assert policy.choose(features(), replicas(1, 1, 1)).id == "r2"
    # A prefix already at home stays there, however much that replica holds.
    assert policy.choose(features(r0=8), replicas(1, 1, 1)).id == "r0"


def test_a_replica_that_just_joined_takes_new_prefixes_only_while_about_as_light_as_the_others() -> None:
    """It owns nothing cached, so every new prefix prefers it; past two requests over the lightest load the
    others take them (by ownership among themselves), where the balance guard alone let it take 8 more."""
    policy = KvAware(random.Random(0))
    held = {"r0": 400, "r1": 200, "r2": 400, "r3": 0}

    def new_prefix(key: int) -> RequestFeatures:
        keys = (key, key + 1, key + 2)
        return RequestFeatures("chat", "m", False, PrefixMatch(PrefixSource.KV_EVENTS, 10, 16, {}, keys, held))

    assert {policy.choose(new_prefix(k), replicas(2, 2, 2, 4)).id for k in range(100)} == {"r3"}
    assert {policy.choose(new_prefix(k), replicas(2, 2, 2, 5)).id for k in range(100)} == {"r1"}
    # A cached prefix is not a new one: it stays with its blocks at that load.
    assert policy.choose(kv_features(10, r3=8), replicas(2, 2, 2, 5)).id == "r3"
    # Known (learned, sighted or told) to run 4 at once, it is full at 4: a new prefix goes where a slot is free.
    full = [dataclasses.replace(r, slots=4) for r in replicas(2, 2, 2, 4)]
    assert {policy.choose(new_prefix(k), full).id for k in range(100)} == {"r1"}
    every_full = [dataclasses.replace(r, slots=2) for r in replicas(2, 2, 2, 4)]
    assert {policy.choose(new_prefix(k), every_full).id for k in range(100)} == {"r3"}


def test_kv_aware_counts_kv_usage() -> None:
    policy = KvAware(random.Random(0), KvAwareWeights(load_weight=0.1, kv_weight=0.5))
    assert policy.choose(kv_features(0), replicas(1, 1, kv=(0.9, 0.1))).id == "r1"


def test_kv_aware_guard_stops_a_hot_prefix_from_overloading_its_replica() -> None:
    policy = KvAware(random.Random(0), KvAwareWeights(load_weight=0.0), BalanceGuard(relative=1.5, absolute=4))
    # Cache says r0, at any load (load_weight 0); the guard says no past 1.5 * 0 + 4 while r1 idles.
    assert policy.choose(kv_features(10, r0=10), replicas(4, 0)).id == "r0"
    decision = policy.choose(kv_features(10, r0=10), replicas(5, 0))
    assert (decision.id, decision.reason) == ("r1", "balance")


def test_kv_aware_without_a_match_spreads_by_load_and_breaks_ties_at_random() -> None:
    policy = KvAware(random.Random(1))
    assert policy.choose(kv_features(4), replicas(2, 1, 2)).id == "r1"
    assert policy.choose(RequestFeatures("chat", "m", False), replicas(2, 1, 2)).reason == "no_match"
    counts = collections.Counter(policy.choose(kv_features(4), replicas(0, 0, 0)).id for _ in range(600))
    assert set(counts) == {"r0", "r1", "r2"} and min(counts.values()) > 150


def test_kv_aware_temperature_samples_lower_costs_more_often() -> None:
    policy = KvAware(random.Random(2), KvAwareWeights(temperature=0.2))
    counts = collections.Counter(policy.choose(kv_features(10, r0=5), replicas(0, 0)).id for _ in range(2000))
    # Costs 0.5 vs 1.0: weights 1 and e^-2.5 = 0.082.
    assert 0.88 < counts["r0"] / 2000 < 0.96


def test_prefix_policy_trusts_only_a_large_match() -> None:
    policy = PrefixAffinity(random.Random(0), min_match=0.5)
    assert policy.choose(text_features(10, r1=6), replicas(1, 2)).reason == "cache_hit"
    assert policy.choose(text_features(10, r1=6), replicas(1, 2)).id == "r1"
    decision = policy.choose(text_features(10, r1=4), replicas(1, 2))
    assert (decision.id, decision.reason) == ("r0", "no_match")
    decision = policy.choose(text_features(10, r1=9), replicas(0, 9))
    assert (decision.id, decision.reason) == ("r0", "balance")


def test_session_keys_stick_to_one_replica_and_spread_over_all() -> None:
    policy = SessionAffinity(random.Random(0))
    fleet = replicas(0, 0, 0, 0)
    first = {
        f"user-{i}": policy.choose(RequestFeatures("chat", "m", False, session_key=f"user-{i}"), fleet).id
        for i in range(400)
    }
    again = {key: policy.choose(RequestFeatures("chat", "m", False, session_key=key), fleet).id for key in first}
    assert first == again
    counts = collections.Counter(first.values())
    assert set(counts) == {"r0", "r1", "r2", "r3"} and min(counts.values()) > 60


def test_session_overflows_to_the_ring_neighbour_past_the_load_bound() -> None:
    policy = SessionAffinity(random.Random(0), load_factor=1.25)
    features = RequestFeatures("chat", "m", False, session_key="hot")
    home = policy.choose(features, replicas(0, 0, 0)).id
    loads = [0, 0, 0]
    loads[int(home[1:])] = 6  # capacity = ceil(1.25 * 7 / 3) = 3
    decision = policy.choose(features, replicas(*loads))
    assert decision.id != home and decision.reason == "overflow"


def test_session_removal_moves_only_that_replicas_keys() -> None:
    policy = SessionAffinity(random.Random(0))
    keys = [f"k{i}" for i in range(300)]
    four = {k: policy.choose(RequestFeatures("chat", "m", False, session_key=k), replicas(0, 0, 0, 0)).id for k in keys}
    three = {k: policy.choose(RequestFeatures("chat", "m", False, session_key=k), replicas(0, 0, 0)).id for k in keys}
    moved = [k for k in keys if four[k] != three[k]]
    assert moved and all(four[k] == "r3" for k in moved)


def test_session_without_a_key_goes_to_the_least_loaded() -> None:
    decision = SessionAffinity(random.Random(0)).choose(RequestFeatures("chat", "m", False), replicas(3, 1))
    assert (decision.id, decision.reason) == ("r1", "no_key")


@pytest.mark.parametrize("name", ["kv_aware", "prefix", "session", "least_loaded", "round_robin"])
def test_every_policy_chooses_among_the_candidates_only(name: str) -> None:
    policy = make_policy(name, random.Random(0))
    features = RequestFeatures("chat", "m", False, PrefixMatch(PrefixSource.KV_EVENTS, 4, 16, {"gone": 4}), "s")
    fleet = replicas(1, 0)
    assert all(policy.choose(features, fleet).id in {"r0", "r1"} for _ in range(20))


def _new_prefix(first_key: int) -> RequestFeatures:
    keys = (first_key, first_key + 1, first_key + 2)
    return RequestFeatures("chat", "m", False, PrefixMatch(PrefixSource.KV_EVENTS, 3, 16, {}, keys))


def test_routers_seeing_a_new_prefix_at_once_choose_the_same_replica() -> None:
    """Each router breaks a tie by the prefix's own hash (rendezvous), not its own random draw: four
    routers with different random states agree on every one of 200 new prefixes, and the prefixes spread."""
    replicas = [ReplicaSnapshot(id=f"r{i}") for i in range(4)]
    routers = [KvAware(rng=random.Random(seed)) for seed in range(4)]
    chosen = collections.Counter()
    for key in range(1000, 1200):
        picks = {router.choose(_new_prefix(key), replicas).id for router in routers}
        assert len(picks) == 1, (key, picks)
        chosen[picks.pop()] += 1
    assert set(chosen) == {"r0", "r1", "r2", "r3"} and min(chosen.values()) > 30, chosen
    # A candidate list in another order picks the same; the load still comes first.
    assert routers[0].choose(_new_prefix(7), replicas[::-1]).id == routers[1].choose(_new_prefix(7), replicas).id
    busy = [ReplicaSnapshot(id=r.id, in_flight=0 if r.id == "r2" else 3) for r in replicas]
    assert all(router.choose(_new_prefix(key), busy).id == "r2" for router in routers for key in range(50))


def test_routers_whose_load_counts_differ_by_a_request_or_two_agree_on_a_new_prefix() -> None:
    """Four peered routers count a replica's load a request or two apart (each sees its own requests at once,
    its peers' a moment later): costs that close are a tie, broken by the prefix's hash, so all four send a
    new prefix to one replica. With exact ties only, each went to its own lightest replica."""
    counts = [(3, 3, 3, 3), (4, 3, 3, 3), (3, 5, 3, 4), (3, 3, 4, 2)]  # each router's view, 2 requests apart at most
    routers = [KvAware(rng=random.Random(seed)) for seed in range(4)]
    chosen = collections.Counter()
    for key in range(2000, 2200):
        views = zip(routers, counts, strict=True)
        picks = {router.choose(_new_prefix(key), replicas(*view)).id for router, view in views}
        assert len(picks) == 1, (key, picks)
        chosen[picks.pop()] += 1
    assert set(chosen) == {"r0", "r1", "r2", "r3"}, chosen  # the near-ties still spread over the replicas


def test_a_clearly_lighter_or_better_cached_replica_still_wins_over_the_hash() -> None:
    policy = KvAware(random.Random(0))
    keys = [(key, key + 1, key + 2) for key in range(3000, 3100)]

    def features(keys: tuple[int, ...], **matched: int) -> RequestFeatures:
        return RequestFeatures("chat", "m", False, PrefixMatch(PrefixSource.KV_EVENTS, 10, 16, matched, keys))

    # Three requests lighter (0.15 in cost, over the 2 requests' tie): the lighter replica, whatever the hash.
    assert {policy.choose(features(k), replicas(3, 3, 0, 3)).id for k in keys} == {"r2"}
    # Two of ten blocks cached (0.2) beat one request less load elsewhere.
    assert {policy.choose(features(k, r1=2), replicas(2, 3, 2, 2)).id for k in keys} == {"r1"}
    # Within the tie (two requests apart), the hash decides: not always the lighter one.
    assert len({policy.choose(features(k), replicas(3, 3, 1, 3)).id for k in keys}) == 4
    # A tie wider or narrower follows its setting: with none, the lighter load again.
    exact = KvAware(random.Random(0), KvAwareWeights(tie_loads=0.0))
    assert {exact.choose(features(k), replicas(3, 3, 2, 3)).id for k in keys} == {"r2"}


def test_new_prefixes_opening_alike_spread_and_one_prefix_keeps_one_replica() -> None:
    """Prompts that open alike (one chat template: the same first block, cached everywhere) are told apart by
    their first block no replica holds, so new prefixes spread; a prefix cached on two replicas goes to one of
    them for every prompt that follows it, whatever its own question."""
    policy = KvAware(random.Random(0))
    fleet = [ReplicaSnapshot(id=f"r{i}") for i in range(4)]
    template = 77

    def prompt(group: int, question: int, **matched: int) -> RequestFeatures:
        keys = (template, 1000 + group, 2000 + group, 3000 + 10 * group + question)
        return RequestFeatures("chat", "m", False, PrefixMatch(PrefixSource.KV_EVENTS, 4, 16, matched, keys))

    everywhere = {r.id: 1 for r in fleet}
    homes = collections.Counter(policy.choose(prompt(g, 0, **everywhere), fleet).id for g in range(200))
    assert set(homes) == {"r0", "r1", "r2", "r3"} and min(homes.values()) > 30, homes
    for group in range(20):
        picks = {policy.choose(prompt(group, q, r1=3, r2=3), fleet).id for q in range(8)}
        assert len(picks) == 1 and picks <= {"r1", "r2"}, picks


def _held_features(key: int, held: dict[str, int], peers: int, **matched: int) -> RequestFeatures:
    keys = (key, key + 1, key + 2)
    match = PrefixMatch(PrefixSource.KV_EVENTS, 10, 16, matched, keys, held, peers=peers)
    return RequestFeatures("chat", "m", False, match)


def test_new_prefixes_spread_over_replicas_holding_near_the_same_and_every_router_agrees() -> None:
    """Routers that count the same held blocks (their peers' routes too) sent every new prefix arriving
    together to the one least-held replica. With peers, a new prefix is drawn by its own hash in proportion to
    exp(-(cost - lowest) / peer_spread): four routers seeing the same new prefixes at the same moment spread
    them, most to the replica holding least, the same in every router; a replica holding clearly less still
    takes them all, and a cached prefix is not drawn."""
    routers = [KvAware(random.Random(seed)) for seed in range(4)]
    fleet = replicas(2, 2, 2, 2)

    def features(key: int, held: dict[str, int], **matched: int) -> RequestFeatures:
        return _held_features(key, held, 3, **matched)

    near = {"r0": 100, "r1": 110, "r2": 115, "r3": 120}  # held costs 0.90-1.08 of the mean
    chosen = collections.Counter()
    for key in range(4000, 4200):
        picks = {router.choose(features(key, near), fleet).id for router in routers}
        assert len(picks) == 1, (key, picks)
        chosen[picks.pop()] += 1
    assert set(chosen) == {"r0", "r1", "r2", "r3"} and 50 < chosen["r0"] < 150, chosen
    assert chosen["r0"] > chosen["r1"] > chosen["r3"], chosen  # in proportion to the weights
    far = {"r0": 100, "r1": 400, "r2": 400, "r3": 400}  # r0 holds 0.9 of the mean less than the others
    assert {routers[0].choose(features(key, far), fleet).id for key in range(4000, 4100)} == {"r0"}
    # A prefix cached on r1 (6 of 10 blocks) and less on r2 (4) stays on r1, however the held counts fall.
    assert {routers[0].choose(features(key, near, r1=6, r2=4), fleet).id for key in range(4000, 4100)} == {"r1"}


def test_a_router_alone_puts_each_new_prefix_on_the_replica_holding_least() -> None:
    """Two replicas under cache pressure, one holding a fifth more of the fleet's cache than the other: a router
    alone sends every new prefix to the one holding less, whatever the prefix's hash, so no replica comes to
    own more groups than its cache keeps (a tie of a quarter of the mean, as peers had, sent them where their
    hash pointed). With peers the same counts are drawn by the hash, most to the one holding less (the others
    may be placing new prefixes at the same moment)."""
    policy = KvAware(random.Random(0))
    held = {"r0": 120, "r1": 100}
    alone = {policy.choose(_held_features(key, held, 0), replicas(1, 1)).id for key in range(5000, 5200)}
    assert alone == {"r1"}
    peered = collections.Counter(policy.choose(_held_features(k, held, 3), replicas(1, 1)).id for k in range(200))
    assert set(peered) == {"r0", "r1"} and peered["r1"] > 2 * peered["r0"] > 20, peered
    # Nearly full against nearly empty: the emptier one, alone or not.
    far = {"r0": 380, "r1": 20}
    assert {policy.choose(_held_features(k, far, p), replicas(1, 1)).id for k in range(100) for p in (0, 3)} == {"r1"}
    # Equal holdings: the prefix's own hash decides, alike in every router (alone or not).
    even = {"r0": 100, "r1": 100}
    other = KvAware(random.Random(9))
    picks = [policy.choose(_held_features(k, even, 0), replicas(1, 1)).id for k in range(200)]
    assert picks == [other.choose(_held_features(k, even, 0), replicas(1, 1)).id for k in range(200)]
    assert min(collections.Counter(picks).values()) > 50


def test_a_fresh_replica_is_not_flooded_by_a_router_alone() -> None:
    """A replica that just joined holds nothing, so a router alone (no held tie) would send it every new
    prefix: it takes them while it has a free slot and is within two requests of the lightest load, and no
    more, as with peers."""
    policy = KvAware(random.Random(0))
    held = {"r0": 400, "r1": 300, "r2": 0}
    fleet = [dataclasses.replace(r, slots=4) for r in replicas(2, 2, 1)]
    assert {policy.choose(_held_features(k, held, 0), fleet).id for k in range(100)} == {"r2"}
    at_its_slots = [dataclasses.replace(r, slots=4) for r in replicas(2, 2, 4)]
    assert {policy.choose(_held_features(k, held, 0), at_its_slots).id for k in range(100)} == {"r1"}
    three_over = [dataclasses.replace(r, slots=8) for r in replicas(1, 1, 4)]
    assert {policy.choose(_held_features(k, held, 0), three_over).id for k in range(100)} == {"r1"}


def test_holdings_far_below_every_cache_leave_new_prefixes_to_the_load() -> None:
    """Held counts are weighed against the replica's own cache where that is larger than the mean holding:
    while every cache has room, owning less is no reason to take every new prefix (a replica that joined
    owns nothing), and load and the prefix's hash decide; once holdings reach the caches' size (pressure),
    the least-held replica takes it, as without a known size."""
    policy = KvAware(random.Random(0))
    held = {"r0": 900, "r1": 700, "r2": 100}

    def fleet(blocks: int) -> list[ReplicaSnapshot]:
        return [dataclasses.replace(r, kv_blocks=blocks) for r in replicas(1, 1, 1)]

    roomy = collections.Counter(policy.choose(_held_features(k, held, 0), fleet(8192)).id for k in range(300))
    assert set(roomy) == {"r0", "r1", "r2"} and min(roomy.values()) > 60, roomy
    assert {policy.choose(_held_features(k, held, 0), fleet(512)).id for k in range(100)} == {"r2"}
    assert {policy.choose(_held_features(k, held, 0), fleet(0)).id for k in range(100)} == {"r2"}
    # With room everywhere the load still counts: the lighter replica, over the two requests' tie.
    busy = [dataclasses.replace(r, kv_blocks=8192) for r in replicas(4, 1, 4)]
    assert {policy.choose(_held_features(k, held, 0), busy).id for k in range(100)} == {"r1"}


def test_peered_routers_whose_held_counts_differ_by_their_own_last_routes_draw_a_new_prefix_alike() -> None:
    """Each of four peered routers has routed one prompt (20 blocks) the others have not heard of yet: their views
    of the held blocks differ by that much (2% of the mean), and they still draw nearly nine in ten new prefixes
    alike (444 of 500; a tie of a quarter of the mean, as before, drew all alike and placed by hash alone)."""
    base = {"r0": 1000, "r1": 1100, "r2": 1200, "r3": 1300}
    views = [{**base, f"r{i}": base[f"r{i}"] + 20} for i in range(4)]
    routers = [KvAware(random.Random(seed)) for seed in range(4)]
    fleet = replicas(2, 2, 2, 2)
    alike = 0
    for key in range(6000, 6500):
        picks = {r.choose(_held_features(key, view, 3), fleet).id for r, view in zip(routers, views, strict=True)}
        alike += len(picks) == 1
    assert alike >= 425, alike
