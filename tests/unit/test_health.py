"""The health state machine: thresholds, passive signals, backpressure; no sockets."""

from __future__ import annotations

import pytest

from dpserve.replicas.health import HealthRules, HealthState, HealthTracker, Outcome, classify_status
from dpserve.replicas.registry import ReplicaRegistry

RULES = HealthRules(fail_threshold=2, rise_threshold=3, passive_fail_threshold=3, backoff_s=5.0)


def admitted() -> tuple[HealthTracker, HealthState]:
    tracker, state = HealthTracker(RULES), HealthState()
    assert tracker.probe_succeeded(state) and state.healthy
    return tracker, state


def test_a_new_replica_is_admitted_on_its_first_passed_probe() -> None:
    tracker, state = HealthTracker(RULES), HealthState()
    assert not tracker.probe_failed(state, 0.0) and not state.healthy
    assert tracker.probe_succeeded(state) and state.healthy


def test_probe_failures_eject_only_at_the_threshold() -> None:
    tracker, state = admitted()
    assert not tracker.probe_failed(state, 1.0) and state.healthy
    assert tracker.probe_succeeded(state) is False  # a pass in between resets the count
    assert not tracker.probe_failed(state, 2.0) and state.healthy
    assert tracker.probe_failed(state, 3.0) and not state.healthy
    assert state.ejected_at == 3.0 and state.ejections == 1


def test_an_ejected_replica_needs_rise_threshold_passes_in_a_row() -> None:
    tracker, state = admitted()
    tracker.observed(state, Outcome.REFUSED, 1.0)
    assert not state.healthy
    assert not tracker.probe_succeeded(state)
    assert not tracker.probe_succeeded(state)
    tracker.probe_failed(state, 2.0)  # a failure restarts the count
    assert not tracker.probe_succeeded(state) and not tracker.probe_succeeded(state)
    assert tracker.probe_succeeded(state) and state.healthy and state.ejected_at is None


def test_a_refused_connection_ejects_at_once() -> None:
    tracker, state = admitted()
    assert tracker.observed(state, Outcome.REFUSED, 1.0) and not state.healthy
    assert not tracker.observed(state, Outcome.REFUSED, 1.1)  # already out: no second transition
    assert state.ejections == 1


@pytest.mark.parametrize("outcome", [Outcome.FAILED, Outcome.SERVER_ERROR])
def test_traffic_failures_eject_after_passive_threshold_in_a_row(outcome: Outcome) -> None:
    tracker, state = admitted()
    assert not tracker.observed(state, outcome, 1.0)
    assert not tracker.observed(state, outcome, 1.0)
    assert not tracker.observed(state, Outcome.OK, 1.0)  # a success resets
    assert not tracker.observed(state, outcome, 1.0) and not tracker.observed(state, outcome, 1.0)
    assert tracker.observed(state, outcome, 1.0) and not state.healthy


def test_soft_failures_never_eject_the_last_replica_standing_but_a_refusal_does() -> None:
    tracker, state = admitted()
    for _ in range(10):
        assert not tracker.observed(state, Outcome.SERVER_ERROR, 1.0, last_standing=True)
        assert not tracker.observed(state, Outcome.FAILED, 1.0, last_standing=True)
    assert state.healthy
    assert tracker.observed(state, Outcome.REFUSED, 1.0, last_standing=True) and not state.healthy


def test_the_registry_keeps_its_last_routable_replica_on_5xx() -> None:
    registry = ReplicaRegistry(["r0=http://a:1", "r1=http://b:2"], RULES)
    for replica in registry:
        registry.probe_succeeded(replica.id)
    for _ in range(RULES.passive_fail_threshold):
        registry.observe("r0", Outcome.SERVER_ERROR)
    assert registry.get("r0").state == "ejected"
    for _ in range(10):
        registry.observe("r1", Outcome.SERVER_ERROR)
    assert registry.get("r1").state == "healthy"  # the last one: only probes may take it out
    registry.probe_failed("r1", "down")
    registry.probe_failed("r1", "down")
    assert registry.get("r1").state == "ejected"


def test_client_errors_never_count() -> None:
    tracker, state = admitted()
    for _ in range(100):
        assert not tracker.observed(state, Outcome.CLIENT_ERROR, 1.0)
    assert state.healthy and state.traffic_failures == 0


def test_backpressure_backs_off_without_ejecting() -> None:
    tracker, state = admitted()
    for _ in range(10):
        assert not tracker.observed(state, Outcome.BACKPRESSURE, 10.0)
    assert state.healthy and state.backed_off(14.9) and not state.backed_off(15.0)


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, Outcome.OK),
        (400, Outcome.CLIENT_ERROR),
        (404, Outcome.CLIENT_ERROR),
        (413, Outcome.CLIENT_ERROR),
        (429, Outcome.BACKPRESSURE),
        (503, Outcome.BACKPRESSURE),
        (500, Outcome.SERVER_ERROR),
        (502, Outcome.SERVER_ERROR),
    ],
)
def test_statuses_are_classified(status: int, outcome: Outcome) -> None:
    assert classify_status(status) is outcome


def test_registry_available_prefers_replicas_not_backing_off() -> None:
    now = [100.0]
    registry = ReplicaRegistry(["r0=http://a:1", "r1=http://b:2"], RULES, clock=lambda: now[0])
    for replica in registry:
        registry.probe_succeeded(replica.id)
    available = lambda **kwargs: [c.id for c in registry.available(registry.healthy(), **kwargs)]  # noqa: E731
    registry.observe("r0", Outcome.BACKPRESSURE)
    assert available() == ["r1"]
    registry.observe("r1", Outcome.BACKPRESSURE)
    assert available() == ["r0", "r1"]  # all backing off: all still candidates
    assert available(fresh_only=True) == [] and available(exclude=["r0"]) == ["r1"]
    now[0] += RULES.backoff_s
    assert available() == ["r0", "r1"]


def test_registry_draining_and_removal() -> None:
    registry = ReplicaRegistry(["r0=http://a:1", "r1=http://b:2"], RULES)
    changes: list[int] = []
    registry.on_change(lambda: changes.append(1))
    for replica in registry:
        registry.probe_succeeded(replica.id)
    registry.set_draining("r0", True)
    assert [r.id for r in registry.healthy()] == ["r1"] and registry.get("r0").state == "draining"
    registry.acquire("r1")
    removed = registry.remove("r1")
    registry.release("r1")  # a request finishing on a removed replica is no error
    assert removed.in_flight == 1 and "r1" not in registry
    added = registry.add("http://c:3@gpu=2")
    assert added.id == "c:3" and added.gpu_hint == ("2",)  # a replica added unnamed is its address
    with pytest.raises(ValueError, match="already a replica"):
        registry.add("http://a:1/")
    with pytest.raises(ValueError, match="already named r0"):
        registry.add("r0=http://d:4")
    assert changes  # listeners heard of the drain and the releases


@pytest.mark.parametrize(
    ("spec", "name", "url", "hint"),
    [
        ("http://10.0.0.5:8000", "10.0.0.5:8000", "http://10.0.0.5:8000", ()),
        ("http://vllm-0", "vllm-0:80", "http://vllm-0", ()),
        ("https://vllm-0.example/", "vllm-0.example:443", "https://vllm-0.example", ()),
        ("http://[fd00::5]:8000@gpu=1", "[fd00::5]:8000", "http://[fd00::5]:8000", ("1",)),
        ("gpu-a=http://10.0.0.5:8000@gpu=0", "gpu-a", "http://10.0.0.5:8000", ("0",)),
        ("r0=http://127.0.0.1:8100", "r0", "http://127.0.0.1:8100", ()),
    ],
)
def test_a_replica_is_named_by_its_name_or_its_address(spec: str, name: str, url: str, hint: tuple[str, ...]) -> None:
    replica = ReplicaRegistry([spec]).get(name)
    assert (replica.url, replica.gpu_hint) == (url, hint)


def test_two_routers_listing_the_same_replicas_in_either_order_name_them_alike() -> None:
    urls = ["http://10.0.0.5:8000", "http://10.0.0.6:8000@gpu=1", "named=http://10.0.0.7:8000"]
    one, other = ReplicaRegistry(urls), ReplicaRegistry(list(reversed(urls)))
    assert {r.id: r.url for r in one} == {r.id: r.url for r in other}
    assert sorted(r.id for r in one) == ["10.0.0.5:8000", "10.0.0.6:8000", "named"]


@pytest.mark.parametrize("spec", ["-x=http://a:1", "a b=http://a:1", f"{'n' * 65}=http://a:1", "é=http://a:1"])
def test_a_replica_name_that_cannot_be_a_label_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="a NAME is"):
        ReplicaRegistry([spec])


def test_held_requests_hear_of_every_scrape_a_peers_ended_requests_and_a_new_replica() -> None:
    # Load that was not this router's ends without any answer of its own: only these can say so.
    registry = ReplicaRegistry(["r0=http://a:1"], RULES)
    heard: list[int] = []
    registry.on_change(lambda: heard.append(1))
    scrape = {"kv_usage": 0.0, "prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0, "block_size": None}
    registry.record_scrape("r0", running=4, waiting=4, **scrape)
    registry.record_scrape("r0", running=0, waiting=0, **scrape)
    assert len(heard) == 2 and registry.get("r0").load == 0
    registry.set_peer_in_flight({"r0": 3})
    assert len(heard) == 2  # more peer load: no room gained
    registry.set_peer_in_flight({})
    assert len(heard) == 3
    registry.add("http://b:2")
    assert len(heard) == 4


def test_a_read_between_probes_refreshes_the_load_but_teaches_no_capacity() -> None:
    # The capacity's rules count scheduled scrapes: reads for held requests, 10 a second, must not speed them.
    registry = ReplicaRegistry(["r0=http://a:1"], RULES)
    scrape = {"kv_usage": 0.0, "prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0, "block_size": None}
    for _ in range(3):
        registry.record_scrape("r0", running=4, waiting=4, scheduled=False, **scrape)
    assert registry.get("r0").capacity == 0 and registry.get("r0").load == 8
    for _ in range(2):
        registry.record_scrape("r0", running=4, waiting=4, **scrape)
    assert registry.get("r0").capacity == 4
