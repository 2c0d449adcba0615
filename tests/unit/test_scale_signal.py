"""The desired-replicas signal: `decide` as a pure function of inputs, state and time (up at once, down only
after a delay of continuous low load, to the most that delay needed), the advisor over a real registry,
catalog and admission queue (start-up measured on a fake clock, the Prometheus series), and the requests
that wait for a replica to start (`ColdStart`). No sockets."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from prometheus_client import CollectorRegistry

from dpserve.replicas.catalog import ModelCatalog, adapter_card
from dpserve.replicas.health import HealthRules
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.flow.admission import Admission
from dpserve.router.http.errors import OpenAIError
from dpserve.router.scale.advisor import ScaleAdvisor, ScaleCollector
from dpserve.router.scale.cold_start import ColdStart
from dpserve.router.scale.held import Held
from dpserve.router.scale.signal import (
    HYSTERESIS,
    TREND_WINDOW_S,
    ScaleInputs,
    ScaleRules,
    ScaleState,
    decide,
    first_state,
    pressure,
    replicas_for,
)

RULES = ScaleRules(target=0.8, down_delay_s=30.0, spread=0.0)
"""The target alone: the arithmetic of most tests below; `spread` has its own."""
MODEL = {"id": "m", "object": "model"}


def held(desired: int, now: float = 0.0, demand: int = 0) -> ScaleState:
    """A signal at `desired` whose trend saw `demand` at `now`: no rise to project from."""
    return ScaleState(desired, "before", -100.0, level=demand, level_at=now, trend_at=now, trend_level=demand)


def run(inputs: ScaleInputs, state: ScaleState, times: list[float], rules: ScaleRules = RULES) -> list[ScaleState]:
    """The signal's states after looking at the same inputs at each of `times`."""
    states = []
    for now in times:
        state = decide(inputs, state, rules, now)
        states.append(state)
    return states


# decide(): up


def test_the_load_over_the_target_share_of_the_capacity_scales_up_at_once() -> None:
    # 8 a replica at 0.8: 6.4 each. 12 / 6.4 = 1.9, 13 / 6.4 = 2.03, 20 / 6.4 = 3.1.
    assert replicas_for(12, 8, 0.8) == 2 and replicas_for(13, 8, 0.8) == 3 and replicas_for(20, 8, 0.8) == 4
    assert replicas_for(8, 10, 0.8) == 1 and replicas_for(9, 10, 0.8) == 2  # exactly at the target fits
    assert replicas_for(0, 8, 0.8) == 0
    for load, expected in ((12, 2), (13, 3), (20, 4), (5, 1)):
        state = decide(ScaleInputs(ready=1, load=load, capacity=8), held(1, 5.0, load), RULES, 5.0)
        assert state.desired == expected
        assert (state.changed_at == 5.0) == (expected != 1)  # changed_at moves only with the count
    up = decide(ScaleInputs(ready=1, load=20, capacity=8), held(1, 5.0, 20), RULES, 5.0)
    assert "load 20" in up.reason and "8 a replica" in up.reason and up.low_since is None


def test_queue_pressure_adds_one_replica_and_none_more_while_one_starts() -> None:
    # The capacity alone asks for 2 (load 5 + 3 queued = 8 over 6.4); the queue waiting long asks one more.
    queued = ScaleInputs(ready=2, load=5, queued=3, queue_wait_s=1.5, capacity=8)
    assert pressure(queued, RULES) is not None and "queued" in (pressure(queued, RULES) or "")
    up = decide(queued, held(2, 0.0, 8), RULES, 0.0)
    assert up.desired == 3 and "queued" in up.reason
    # The replica asked for is starting: the queue waits for it, no runaway however long it lasts.
    starting = dataclasses.replace(queued, starting=1)
    assert [s.desired for s in run(starting, up, [float(t) for t in range(1, 20)])] == [3] * 19
    # Nothing starts (the actor has not acted yet): still just one more than runs, not one more per look.
    assert [s.desired for s in run(queued, up, [float(t) for t in range(1, 20)])] == [3] * 19
    # A queue that has not waited `queue_wait_s` yet is no pressure.
    fresh = dataclasses.replace(queued, queue_wait_s=0.5)
    assert pressure(fresh, RULES) is None and decide(fresh, held(2, 0.0, 8), RULES, 0.0).desired == 2


def test_kv_pressure_and_missed_slos_add_one_replica() -> None:
    calm = ScaleInputs(ready=2, load=2, capacity=8, kv_usage=0.5, slo_attainment=0.95)
    assert decide(calm, held(2, 0.0, 2), RULES, 0.0).desired == 2
    full = decide(dataclasses.replace(calm, kv_usage=0.95), held(2, 0.0, 2), RULES, 0.0)
    assert full.desired == 3 and "KV caches 95% full" in full.reason
    missed = decide(dataclasses.replace(calm, slo_attainment=0.5), held(2, 0.0, 2), RULES, 0.0)
    assert missed.desired == 3 and "SLO attainment 50%" in missed.reason
    # Full KV caches of no ready replica say nothing.
    assert pressure(ScaleInputs(starting=1, kv_usage=0.99), RULES) is None


def test_requests_waiting_with_no_replica_ask_for_one() -> None:
    waiting = ScaleInputs(queued=2)  # capacity not measured: there was never a replica
    state = decide(waiting, held(0), RULES, 1.0)
    assert state.desired == 1 and state.reason == "2 request(s) waiting and no replica"
    # One is starting: it is what they wait for.
    assert decide(dataclasses.replace(waiting, starting=1), held(1), RULES, 1.0).desired == 1
    # The first look, with requests already waiting and nothing running.
    assert decide(waiting, first_state(waiting, 0.0), RULES, 0.0).desired == 1


# decide(): down


def test_no_load_and_no_capacity_known_lets_replicas_go_only_after_the_delay() -> None:
    idle = ScaleInputs(ready=1)
    states = run(idle, held(1), [0.0, 10.0, 29.9, 30.0])
    assert [s.desired for s in states] == [1, 1, 1, 0]
    assert states[0].low_since == 0.0 and states[-1].changed_at == 30.0
    # Some load, capacity still unknown: nothing to size a scale-down by, so the replicas stay.
    busy = ScaleInputs(ready=2, load=5)
    assert [s.desired for s in run(busy, held(2), [0.0, 100.0, 1000.0])] == [2, 2, 2]


def test_a_scale_down_waits_the_delay_and_goes_to_the_most_it_needed() -> None:
    state = held(4, demand=5)
    looks = [(0.0, 5), (10.0, 12), (20.0, 3)]  # smoothed: 5, ~11, ~4: enough for 1, then 2, then 1 replica
    for now, load in looks:
        state = decide(ScaleInputs(ready=4, load=load, capacity=10), state, RULES, now)
        assert state.desired == 4 and state.low_since == 0.0
    assert state.lows == ((10.0, 2), (20.0, 1))  # the most of the window first
    state = decide(ScaleInputs(ready=4, load=3, capacity=10), state, RULES, 30.0)
    assert state.desired == 2 and state.changed_at == 30.0 and "2 enough for 30 s" in state.reason
    # The window rolls on: once the look that needed 2 is a delay old, the next step down, not a delay later.
    assert state.low_since == 10.0
    later = run(ScaleInputs(ready=2, load=3, capacity=10), state, [35.0, 40.0])
    assert [s.desired for s in later] == [2, 1] and later[-1].changed_at == 40.0


def test_one_burst_in_the_delay_starts_it_over() -> None:
    """A look whose own load needs what runs starts the delay over: going below it flapped down and up."""
    night = ScaleInputs(ready=2, load=1, capacity=4)  # 1 a replica of 4 at 0.64: one is enough
    state = decide(night, held(2, demand=1), RULES, 0.0)
    assert state.low_since == 0.0 and state.lows == ((0.0, 1),)
    state = decide(dataclasses.replace(night, load=4), state, RULES, 6.0)  # 4 needs 2 at 3.2 a replica
    assert state.desired == 2 and state.low_since is None
    states = run(night, state, [10.0, 30.0, 39.9, 40.0])
    assert [s.desired for s in states] == [2, 2, 2, 1]


def test_load_coming_back_during_the_delay_cancels_the_scale_down() -> None:
    low, back = ScaleInputs(ready=4, load=5, capacity=10), ScaleInputs(ready=4, load=30, capacity=10)
    state = decide(low, held(4), RULES, 0.0)
    assert state.low_since == 0.0
    state = decide(back, state, RULES, 15.0)  # needs all 4 again (30 over 8 a replica)
    assert state.desired == 4 and state.low_since is None
    state = decide(low, state, RULES, 40.0)  # the delay starts over (the smoothed load fell below by then)
    assert state.low_since == 40.0
    assert [s.desired for s in run(low, state, [65.0, 69.9, 70.0])] == [4, 4, 1]


def test_the_delay_is_at_least_twice_the_measured_startup() -> None:
    idle = ScaleInputs(ready=2, capacity=10, startup_s=40.0)
    states = run(idle, held(2), [0.0, 30.0, 79.9, 80.0])
    assert [s.desired for s in states] == [2, 2, 2, 0]
    assert "for 80 s" in states[-1].reason
    short = dataclasses.replace(idle, startup_s=5.0)  # twice 5 s is under the delay: the delay holds
    assert [s.desired for s in run(short, held(2), [0.0, 29.9, 30.0])] == [2, 2, 0]


def test_a_load_just_under_the_target_of_fewer_replicas_does_not_scale_down() -> None:
    # 2 replicas of 10 hold 16 at the 0.8 target, and 12.8 at the hysteresis' 0.64.
    assert RULES.target * (1 - HYSTERESIS) == pytest.approx(0.64)
    for load in (13, 15, 16):
        inputs = ScaleInputs(ready=3, load=load, capacity=10)
        states = run(inputs, held(3, demand=load), [0.0, 100.0, 1000.0])
        assert [s.desired for s in states] == [3, 3, 3] and all(s.low_since is None for s in states)
    below = ScaleInputs(ready=3, load=12, capacity=10)
    assert [s.desired for s in run(below, held(3, demand=12), [0.0, 29.0, 30.0])] == [3, 3, 2]


def test_a_rising_load_is_projected_one_startup_ahead() -> None:
    rising = ScaleInputs(ready=2, load=15, capacity=10, startup_s=20.0)
    # 10 steady until 0 s, 15 at 10 s: smoothed over 5 s, ~14.3, a rise of ~0.43 a second over the window.
    was = ScaleState(2, "before", -100.0, level=10.0, level_at=0.0, trend_at=0.0, trend_level=10.0)
    state = decide(rising, was, RULES, TREND_WINDOW_S)
    assert state.desired == 3  # (15 + ~0.43/s * 20 s) over 8 a replica; 15 alone fits in 2
    assert "rising to ~24" in state.reason
    assert state.trend_at == 0.0 and state.trend_level == 10.0  # the window goes on
    assert decide(dataclasses.replace(rising, startup_s=None), was, RULES, TREND_WINDOW_S).desired == 2
    # A falling load projects nothing, and the delay before a scale-down starts.
    fell = dataclasses.replace(was, desired=4, level=30.0, trend_level=30.0)
    falling = decide(rising, fell, RULES, TREND_WINDOW_S)
    assert falling.desired == 4 and falling.low_since == TREND_WINDOW_S and "rising" not in falling.reason
    # Past twice the window the rise is measured afresh, from this look.
    later = decide(rising, was, RULES, 2 * TREND_WINDOW_S)
    assert later.trend_at == 2 * TREND_WINDOW_S and later.trend_level == later.level


def test_a_burst_between_two_close_looks_is_no_trend() -> None:
    """Found by review: a rise measured over the gap between two looks (50 ms) turned a jitter of 2 requests
    into a projection of 190 replicas."""
    was = ScaleState(2, "before", -100.0, level=10.0, level_at=9.95, trend_at=0.0, trend_level=10.0)
    burst = ScaleInputs(ready=2, load=12, capacity=8, startup_s=30.0)
    assert decide(burst, was, RULES, 10.0).desired == 2  # 12 + well under one request ahead, over 6.4 a replica
    flood = ScaleInputs(ready=2, load=40, capacity=8, startup_s=30.0)
    assert decide(flood, was, RULES, 10.0).desired <= 7  # at most a little ahead of the 40 seen: never 190


def test_the_projection_is_at_most_as_much_again() -> None:
    steep = ScaleInputs(ready=1, load=8, capacity=8, startup_s=1000.0)
    was = ScaleState(1, "before", -100.0, level=0.0, level_at=0.0, trend_at=0.0, trend_level=0.0)
    assert decide(steep, was, RULES, TREND_WINDOW_S).desired == 3  # (8 + 8) over 6.4


def test_the_spread_holds_a_bursty_load_in_replicas_of_few_slots() -> None:
    """Random arrivals put a load of L at about L +- sqrt(L): replicas of 4 slots at 80% queued in every burst
    of the elastic day's ramp. The spread sizes the smoothed load; each look's own load goes by the target
    alone, so a burst is not counted twice."""
    spread = dataclasses.replace(RULES, spread=1.0)
    peak = ScaleInputs(ready=3, load=8, capacity=4)
    assert decide(peak, held(3, demand=8), RULES, 0.0).desired == 3  # 8 over 3.2 a replica
    assert decide(peak, held(3, demand=8), spread, 0.0).desired == 4  # 8 + sqrt(8) over 3.2
    # Night: a burst of 2 over a smoothed load of 1 stays on one replica (1 + sqrt(1) over 3.2).
    night = decide(ScaleInputs(ready=1, load=2, capacity=4), held(1, demand=1), spread, 0.0)
    assert night.desired == 1
    # At GPU sizes it is a few percent: 180 of 256 a replica at 80% (204.8) with 13 more still fits one.
    assert decide(ScaleInputs(ready=1, load=180, capacity=256), held(1, demand=180), spread, 0.0).desired == 1


def test_the_first_state_is_what_runs_now() -> None:
    inputs = ScaleInputs(ready=2, starting=1, load=4, queued=1)
    state = first_state(inputs, 7.0)
    assert (state.desired, state.changed_at, state.trend_at, state.trend_level) == (3, 7.0, 7.0, 5.0)


# The advisor over a real registry, catalog and admission queue.


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fleet(healthy: int, starting: int = 0, told_slots: int = 0) -> tuple[ReplicaRegistry, ModelCatalog]:
    """Replicas r0.. serving "m": the first `healthy` probed healthy, the next `starting` added, not probed."""
    specs = [f"r{index}=http://127.0.0.1:{index + 1}" for index in range(healthy + starting)]
    registry = ReplicaRegistry(specs, HealthRules(rise_threshold=1), told_slots=told_slots)
    catalog = ModelCatalog(registry)
    for index, replica in enumerate(registry):
        catalog.set_model_cards(replica.id, (MODEL,))
        if index < healthy:
            registry.probe_succeeded(replica.id)
    return registry, catalog


def scrape(registry: ReplicaRegistry, replica_id: str, running: int, waiting: int, times: int = 2) -> None:
    """`times` scrapes alike; two in a row that find requests waiting teach the capacity (`capacity.py`)."""
    for _ in range(times):
        registry.record_scrape(
            replica_id,
            running=running,
            waiting=waiting,
            kv_usage=0.5,
            prefix_cache_queries=0.0,
            prefix_cache_hits=0.0,
            block_size=16,
        )


def advisor_over(registry: ReplicaRegistry, catalog: ModelCatalog, clock: Clock) -> ScaleAdvisor:
    return ScaleAdvisor(registry, catalog, Admission(0, 16, 5.0, clock=clock), RULES, clock=clock)


def sample(prometheus: CollectorRegistry, name: str, **labels: str) -> float | None:
    return prometheus.get_sample_value(name, labels)


def test_the_advisor_scales_with_the_replicas_load_and_measures_a_startup() -> None:
    clock = Clock()
    registry, catalog = fleet(healthy=2)
    advisor = advisor_over(registry, catalog, clock)
    advisor.tick()
    assert advisor.states["m"].desired == 2 and advisor.version == 0 and not advisor.history
    assert advisor.startup_s is None and advisor.eta_s() is None

    # Both full: 8 running and 2 waiting each, a load of 20 over 8 a replica.
    for replica_id in ("r0", "r1"):
        scrape(registry, replica_id, running=8, waiting=2)
    assert registry.get("r0").capacity == 8
    clock.now = 1001.0
    advisor.tick()
    inputs = advisor.inputs["m"]
    assert (inputs.ready, inputs.starting, inputs.load, inputs.capacity) == (2, 0, 20, 8)
    assert advisor.states["m"].desired == 4 and advisor.desired() == 4 and advisor.version == 1
    assert advisor.history[-1]["from"] == 2 and advisor.history[-1]["to"] == 4
    assert "load 20" in advisor.history[-1]["reason"] and advisor.changes[("m", "up")] == 1

    # Whoever acts on it adds a replica; it counts as starting, then serves 11 s after the signal rose.
    clock.now = 1005.0
    registry.add("r2=http://127.0.0.1:3")
    advisor.tick()
    assert advisor.inputs["m"].starting == 1 and advisor.version == 1
    clock.now = 1012.0
    catalog.set_model_cards("r2", (MODEL,))
    registry.probe_succeeded("r2")
    advisor.tick()
    assert advisor.inputs["m"].ready == 3 and list(advisor.startups) == [pytest.approx(11.0)]
    assert advisor.startup_s == pytest.approx(11.0)
    # Still one short of 4: the next one is counted from this one's arrival.
    assert advisor.eta_s() == pytest.approx(11.0)
    clock.now = 1016.0
    assert advisor.eta_s() == pytest.approx(7.0)
    clock.now = 1040.0
    assert advisor.eta_s() == 0.0

    # Measured, the start-up also projects the load's jump (0 to 20 within a second) one start-up ahead.
    assert advisor.version == 2 and advisor.desired() > 4 and "rising" in advisor.history[-1]["reason"]
    status = advisor.status()
    assert status["version"] == 2 and status["desired"] == advisor.desired() and status["startup_seconds"] == 11.0
    assert status["models"][0]["model"] == "m" and "load 20" in status["models"][0]["reason"]
    assert status["waiting_for_replica"] == 0 and status["history"][-1]["to"] == advisor.desired()

    prometheus = CollectorRegistry()
    prometheus.register(ScaleCollector(advisor))
    assert sample(prometheus, "dpserve_desired_replicas", model="m") == advisor.desired()
    assert sample(prometheus, "dpserve_scale_replicas", model="m", state="ready") == 3.0
    assert sample(prometheus, "dpserve_scale_replicas", model="m", state="starting") == 0.0
    assert sample(prometheus, "dpserve_scale_load_requests", model="m") == 20.0
    assert sample(prometheus, "dpserve_scale_capacity_requests", model="m") == 8.0
    assert sample(prometheus, "dpserve_scale_queue_depth", model="m") == 0.0
    assert sample(prometheus, "dpserve_scale_kv_usage_ratio", model="m") == pytest.approx(1.0 / 3)
    assert sample(prometheus, "dpserve_scale_startup_seconds", model="m") == pytest.approx(11.0)
    assert sample(prometheus, "dpserve_scale_changes_total", model="m", direction="up") == 2.0
    assert sample(prometheus, "dpserve_scale_slo_attainment_ratio", model="m") is None  # no SLO seen


def test_one_scrape_with_requests_waiting_sizes_the_fleet_before_the_capacity_is_learned() -> None:
    """Flow control learns a capacity from two scrapes in a row that find requests waiting; the signal reads
    one: on a ramp, short waits rarely span two scrapes, and without a capacity only one more replica at a
    time could be asked for."""
    clock = Clock()
    registry, catalog = fleet(healthy=1)
    advisor = advisor_over(registry, catalog, clock)
    advisor.tick()
    scrape(registry, "r0", running=4, waiting=7, times=1)
    assert registry.get("r0").capacity == 0 and registry.get("r0").learned.sighted == 4
    clock.now = 1001.0
    advisor.tick()
    assert advisor.inputs["m"].capacity == 4
    # A load of 11 over 4 a replica at 80%: four replicas at once, not one more.
    assert advisor.states["m"].desired == 4 and "load 11" in advisor.history[-1]["reason"]


def test_a_told_capacity_sizes_the_fleet_until_one_is_seen() -> None:
    """`--replica-max-num-seqs`: the first burst on a fresh router, before any replica was seen full, is sized by
    what the operator told vLLM; a capacity seen wins over it."""
    clock = Clock()
    registry, catalog = fleet(healthy=1, told_slots=4)
    untold_registry, untold_catalog = fleet(healthy=1)
    advisor = advisor_over(registry, catalog, clock)
    untold = advisor_over(untold_registry, untold_catalog, clock)
    advisor.tick()
    untold.tick()
    for fleet_registry in (registry, untold_registry):
        scrape(fleet_registry, "r0", running=9, waiting=0, times=1)  # running, none waiting: not seen full
    assert registry.get("r0").learned.sighted == 0
    assert (registry.get("r0").slots, untold_registry.get("r0").slots) == (4, 0)  # routing reads the same
    clock.now = 1001.0
    advisor.tick()
    untold.tick()
    # A load of 9 over 4 a replica at 80%: three replicas; untold, with no pressure, it stays at one.
    assert advisor.inputs["m"].capacity == 4 and advisor.states["m"].desired == 3
    assert untold.inputs["m"].capacity == 0 and untold.states["m"].desired == 1
    scrape(registry, "r0", running=8, waiting=3, times=1)
    clock.now = 1002.0
    advisor.tick()
    assert advisor.inputs["m"].capacity == 8  # seen full at 8: the replica's own figure
    assert registry.get("r0").slots == 8


def test_replicas_serving_when_the_signal_first_rises_are_no_startup() -> None:
    """The first look sees replicas already serving and a load that needs more: none of those started for it."""
    clock = Clock()
    registry, catalog = fleet(healthy=2)
    for replica_id in ("r0", "r1"):
        scrape(registry, replica_id, running=8, waiting=2)
    advisor = advisor_over(registry, catalog, clock)
    advisor.tick()
    assert advisor.states["m"].desired == 4 and not advisor.startups and advisor.eta_s() is None
    clock.now += 30.0
    registry.add("r2=http://127.0.0.1:3")
    catalog.set_model_cards("r2", (MODEL,))
    registry.probe_succeeded("r2")
    advisor.tick()
    assert list(advisor.startups) == [pytest.approx(30.0)]


def test_a_drained_replica_resumed_is_no_startup() -> None:
    """A draining replica resumed when the signal rises serves at once: that is no start-up to learn from."""
    clock = Clock()
    registry, catalog = fleet(healthy=2)
    registry.set_draining("r1", True)
    advisor = advisor_over(registry, catalog, clock)
    advisor.tick()
    scrape(registry, "r0", running=8, waiting=12)
    clock.now += 1.0
    advisor.tick()
    assert advisor.states["m"].desired >= 3  # 20 over 6.4 a replica: one resumed is not enough
    clock.now += 0.2
    registry.set_draining("r1", False)
    advisor.tick()
    assert not advisor.startups
    clock.now += 20.0
    registry.add("r2=http://127.0.0.1:3")  # a replica that did start for it
    advisor.tick()
    clock.now += 10.0
    catalog.set_model_cards("r2", (MODEL,))
    registry.probe_succeeded("r2")
    advisor.tick()
    assert list(advisor.startups) == [pytest.approx(30.2)]


def test_the_advisor_scales_down_after_the_delay_and_counts_it() -> None:
    clock = Clock()
    registry, catalog = fleet(healthy=3)
    advisor = advisor_over(registry, catalog, clock)
    advisor.tick()
    assert advisor.states["m"].desired == 3
    for replica_id in ("r0", "r1", "r2"):
        scrape(registry, replica_id, running=2, waiting=1)  # capacity 2, a load of 9 over 1.6 a replica
    clock.now += 1.0
    advisor.tick()
    assert advisor.states["m"].desired == 6
    for replica_id in ("r0", "r1", "r2"):  # the load ends
        scrape(registry, replica_id, running=0, waiting=0, times=1)
    desired = []
    for _ in range(40):
        clock.now += 1.0
        advisor.tick()
        desired.append(advisor.states["m"].desired)
    # A delay of looks that needed fewer, then down to the most of the window, and on as it rolls: to 0.
    assert desired[:30] == [6] * 30 and desired[30] < 6 and desired[-1] == 0, desired
    assert desired == sorted(desired, reverse=True)
    assert advisor.changes[("m", "up")] == 1 and advisor.changes[("m", "down")] == len(set(desired)) - 1
    assert advisor.history[-1]["to"] == 0
    assert advisor.eta_s() is None  # nothing was ever seen to start


async def test_requests_queued_in_the_router_raise_the_signal_through_admission() -> None:
    clock = Clock()
    registry, catalog = fleet(healthy=1)
    admission = Admission(1, 16, 60.0, clock=clock)
    advisor = ScaleAdvisor(registry, catalog, admission, RULES, clock=clock)
    advisor.tick()
    assert advisor.states["m"].desired == 1
    held_request = asyncio.create_task(admission.wait_for_room(lambda: False, model="m"))
    await asyncio.sleep(0)
    assert admission.depth == 1
    advisor.tick()  # queued, but not for long yet
    assert advisor.states["m"].desired == 1 and advisor.inputs["m"].queued == 1
    clock.now += 2.0
    advisor.tick()
    assert advisor.states["m"].desired == 2 and advisor.inputs["m"].queue_wait_s == pytest.approx(2.0)
    held_request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held_request


async def test_requests_queued_for_one_model_raise_its_signal_alone() -> None:
    """The router's queue is shared, the signal is per model: a request held for a model (or for an adapter on
    it) asks for a replica of that model only."""
    clock = Clock()
    registry, catalog = fleet(healthy=2)
    catalog.set_model_cards("r0", (MODEL, adapter_card("sql", "/adapters/sql", "m", MODEL)))
    catalog.set_model_cards("r1", ({"id": "other", "object": "model"},))
    admission = Admission(1, 16, 60.0, clock=clock)
    advisor = ScaleAdvisor(registry, catalog, admission, RULES, clock=clock)
    advisor.tick()
    asked = ("other", "other", "sql")
    held = [asyncio.create_task(admission.wait_for_room(lambda: False, model=name)) for name in asked]
    await asyncio.sleep(0)
    clock.now += 2.0
    advisor.tick()
    assert (advisor.inputs["other"].queued, advisor.states["other"].desired) == (2, 2)
    assert (advisor.inputs["m"].queued, advisor.states["m"].desired) == (1, 2)
    assert advisor.inputs["m"].queue_wait_s == pytest.approx(2.0)
    for request in held:
        request.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    advisor.tick()
    assert advisor.inputs["other"].queued == advisor.inputs["m"].queued == 0


async def test_requests_held_in_peer_routers_count_as_this_routers_own() -> None:
    """Each router (or `--workers` sibling) holds its share of the queue; the signal counts every router's, so
    whichever router the supervisor or the autoscaler asks says the same. From zero too: a request waiting in
    a peer for a replica of a model no replica serves asks this router's signal for one."""
    clock = Clock()
    registry, catalog = fleet(healthy=0)
    admission = Admission(1, 16, 60.0, clock=clock)
    advisor = ScaleAdvisor(registry, catalog, admission, RULES, clock=clock)
    advisor.tick()
    assert advisor.desired() == 0
    cold = Held(cold=1, cold_since=clock.now - 0.5)
    advisor.peer_held("worker-1", {"m": cold})  # a cold start in a sibling worker
    advisor.tick()
    assert advisor.states["m"].desired == 1 and advisor.inputs["m"].queue_wait_s == pytest.approx(0.5)
    registry.add("r0=http://127.0.0.1:1")
    catalog.set_model_cards("r0", (MODEL,))
    registry.probe_succeeded("r0")
    clock.now += 3.0
    advisor.tick()
    # Ready here, the replica it waited for serves: its wait is no queue (the sibling has not yet seen it).
    assert advisor.inputs["m"].queued == 0 and advisor.states["m"].desired == 1
    # Its own and two peers' queues add up; the oldest wait is the oldest anywhere.
    own = asyncio.create_task(admission.wait_for_room(lambda: False, model="m"))
    await asyncio.sleep(0)
    advisor.peer_held("worker-1", {"m": Held(2, clock.now - 3.0)})
    advisor.peer_held("other-router", {"m": Held(1, clock.now - 1.0), "z": Held(cold=4, cold_since=clock.now)})
    assert advisor.own_held() == {"m": Held(1, clock.now)}
    advisor.tick()
    assert advisor.inputs["m"].queued == 4 and advisor.inputs["m"].queue_wait_s == pytest.approx(3.0)
    assert advisor.inputs["z"].queued == 4  # a model only a peer's requests ask for, no replica serving it
    advisor.peer_held("worker-1", {})
    advisor.peer_held("other-router", {})
    advisor.tick()
    assert advisor.inputs["m"].queued == 1 and advisor.inputs["z"].queued == 0
    own.cancel()
    await asyncio.gather(own, return_exceptions=True)


async def test_wait_change_returns_once_the_signal_moves() -> None:
    registry, catalog = fleet(healthy=1)
    advisor = ScaleAdvisor(registry, catalog, Admission(0, 16, 5.0), RULES, interval_s=60.0)
    advisor.start()
    try:
        await asyncio.sleep(0.01)  # the first look
        assert advisor.states["m"].desired == 1 and advisor.version == 0
        await asyncio.wait_for(advisor.wait_change(0, 0.05), 1.0)  # nothing moves: it returns at its timeout
        waiter = asyncio.create_task(advisor.wait_change(0, 5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        registry.add("r1=http://127.0.0.1:2")  # the fleet changed: the advisor looks at once, not in 60 s
        await asyncio.wait_for(waiter, 1.0)
        assert advisor.version == 1 and advisor.states["m"].desired == 2
    finally:
        await advisor.stop()


# Requests that wait for a replica to start.


class Cold:
    """A fleet whose requests wait up to `wait_s` for a replica. ColdStart reads time.monotonic: so does this
    advisor, so a waiter's age is in one clock."""

    def __init__(self, wait_s: float, healthy: int = 0, starting: int = 0) -> None:
        self.registry, self.catalog = fleet(healthy, starting)
        self.advisor = ScaleAdvisor(self.registry, self.catalog, Admission(0, 16, 5.0), RULES)
        self.start = ColdStart(self.catalog, self.advisor, wait_s)


def test_cold_start_covers_no_replica_and_unknown_models_only_before_any_serves() -> None:
    none_healthy = OpenAIError(503, "none", type="service_unavailable", code="no_healthy_replica")
    unknown = OpenAIError(404, "no such model", code="model_not_found")
    other = OpenAIError(400, "bad", code="invalid_value")
    cold = Cold(1.0, starting=1).start
    assert cold.covers(none_healthy) and cold.covers(unknown) and not cold.covers(other)
    serving = Cold(1.0, healthy=1).start
    assert serving.covers(none_healthy) and not serving.covers(unknown)  # the name can be checked: it is wrong


async def test_a_startup_longer_than_the_wait_is_refused_at_once() -> None:
    fleet_ = Cold(0.2)
    advisor, cold = fleet_.advisor, fleet_.start
    advisor.startups.append(30.0)
    with pytest.raises(OpenAIError) as refused:
        await asyncio.wait_for(cold.wait("m"), 0.1)  # at once, not after the wait
    error = refused.value
    assert (error.status, error.code, error.headers["retry-after"]) == (503, "replica_starting", "30")
    assert advisor.cold.total == 0  # no one waits...
    # ... but the signal asks for the replica its retry needs, until its Retry-After.
    now = time.monotonic()
    assert advisor.cold.count("m", now) == 1 and advisor.read("m", now).queued == 1
    assert advisor.cold.count("m", now + 31.0) == 0


async def test_no_replica_in_time_is_refused_at_the_end_of_the_wait() -> None:
    fleet_ = Cold(0.2)
    advisor, cold = fleet_.advisor, fleet_.start
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(OpenAIError) as refused:
        await cold.wait("m")
    assert 0.2 <= loop.time() - began < 1.0
    error = refused.value
    assert (error.status, error.code, error.headers["retry-after"]) == (503, "replica_starting", "1")
    assert advisor.cold.total == 0 and advisor.cold.models() == []


async def test_a_waiting_request_is_counted_by_the_signal_and_goes_once_a_replica_serves() -> None:
    fleet_ = Cold(2.0)
    registry, advisor, cold = fleet_.registry, fleet_.advisor, fleet_.start
    waiting = asyncio.create_task(cold.wait("m"))
    await asyncio.sleep(0.01)
    assert advisor.cold.count("m", time.monotonic()) == 1 and not waiting.done()
    advisor.tick()
    assert advisor.inputs["m"].queued == 1 and advisor.states["m"].desired == 1
    assert advisor.states["m"].reason == "1 request(s) waiting and no replica"

    registry.add("r0=http://127.0.0.1:1")  # what acts on the signal starts one: it reports its model, then serves
    fleet_.catalog.set_model_cards("r0", (MODEL,))
    assert not waiting.done()
    registry.probe_succeeded("r0")
    await asyncio.wait_for(waiting, 1.0)
    assert advisor.cold.total == 0 and advisor.cold.models() == []
    advisor.tick()
    assert advisor.inputs["m"].queued == 0 and advisor.inputs["m"].ready == 1 and advisor.startup_s is not None


async def test_a_client_that_leaves_is_no_longer_counted() -> None:
    fleet_ = Cold(5.0, starting=1)
    advisor, cold = fleet_.advisor, fleet_.start
    waiting = [asyncio.create_task(cold.wait("m")) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert advisor.cold.count("m", time.monotonic()) == 2 and advisor.read("m", 0.0).queued == 2
    waiting[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting[0]
    assert advisor.cold.count("m", time.monotonic()) == 1
    waiting[1].cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting[1]
    assert advisor.cold.total == 0 and advisor.read("m", 0.0).queued == 0
