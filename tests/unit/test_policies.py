from __future__ import annotations

import collections
import random

import pytest

from dpserve.policies import POLICY_NAMES, ReplicaSnapshot, RequestFeatures, make_policy
from dpserve.policies.least_loaded import LeastLoaded
from dpserve.policies.round_robin import RoundRobin

FEATURES = RequestFeatures(endpoint="chat", model="m", stream=False)


def test_round_robin_takes_turns() -> None:
    policy = RoundRobin()
    replicas = [ReplicaSnapshot("r0"), ReplicaSnapshot("r1"), ReplicaSnapshot("r2")]
    assert [policy.choose(FEATURES, replicas).id for _ in range(6)] == ["r0", "r1", "r2"] * 2


def test_round_robin_survives_a_shrinking_candidate_list() -> None:
    policy = RoundRobin()
    three = [ReplicaSnapshot("r0"), ReplicaSnapshot("r1"), ReplicaSnapshot("r2")]
    policy.choose(FEATURES, three)
    policy.choose(FEATURES, three)
    assert policy.choose(FEATURES, three[:1]).id == "r0"


def test_least_loaded_picks_fewest_in_flight() -> None:
    policy = LeastLoaded(random.Random(0))
    replicas = [ReplicaSnapshot(f"r{i}", in_flight=load) for i, load in enumerate((3, 1, 2))]
    assert policy.choose(FEATURES, replicas).id == "r1"


def test_least_loaded_counts_load_the_replica_reports_from_other_clients() -> None:
    policy = LeastLoaded(random.Random(0))
    # r0: 1 of ours, but the replica reports 5 running + 2 waiting with only 1 of ours then: 6 from elsewhere.
    busy = ReplicaSnapshot("r0", in_flight=1, running=5, waiting=2, in_flight_at_scrape=1)
    idle = ReplicaSnapshot("r1", in_flight=2, running=2, waiting=0, in_flight_at_scrape=2)
    assert busy.load == 7 and idle.load == 2
    assert policy.choose(FEATURES, [busy, idle]).id == "r1"


def test_least_loaded_does_not_count_routed_requests_twice() -> None:
    # The scrape saw our 3 requests running; counting them again would make r0 look twice as busy as it is.
    ours = ReplicaSnapshot("r0", in_flight=3, running=3, in_flight_at_scrape=3)
    assert ours.load == 3


def test_least_loaded_prefers_emptier_kv_cache_on_equal_load() -> None:
    policy = LeastLoaded(random.Random(0))
    replicas = [ReplicaSnapshot("r0", in_flight=1, kv_usage=0.8), ReplicaSnapshot("r1", in_flight=1, kv_usage=0.1)]
    assert all(policy.choose(FEATURES, replicas).id == "r1" for _ in range(20))


def test_least_loaded_breaks_ties_at_random_not_always_the_first() -> None:
    policy = LeastLoaded(random.Random(1234))
    replicas = [ReplicaSnapshot(f"r{index}") for index in range(4)]
    counts = collections.Counter(policy.choose(FEATURES, replicas).id for _ in range(4000))
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    assert all(800 < count < 1200 for count in counts.values()), counts


def test_make_policy_knows_every_name_and_refuses_others() -> None:
    assert {make_policy(name).name for name in POLICY_NAMES} == set(POLICY_NAMES)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
