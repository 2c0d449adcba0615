"""Where a LoRA adapter's request goes (`policies/adapters.py`): pure functions of the replicas' adapter
slots and load, tested without sockets."""

from __future__ import annotations

import collections
import random

from dpserve.policies.adapters import AdapterSlots, LoadPlan, place, plan_load
from dpserve.policies.balance import BalanceGuard
from dpserve.policies.base import ReplicaSnapshot


def slots_of(
    max_loras: int,
    loaded: frozenset[str] = frozenset(),
    busy: frozenset[str] = frozenset(),
    last_used: dict[str, float] | None = None,
    in_flight: dict[str, int] | None = None,
) -> AdapterSlots:
    """A replica that keeps exactly `max_loras` adapters loaded (`--lora-slots` equal to `--max-loras`)."""
    return AdapterSlots(max_loras, loaded, busy, last_used or {}, in_flight or {}, capacity=max_loras)


def replica(rid: str, load: int = 0) -> ReplicaSnapshot:
    return ReplicaSnapshot(rid, in_flight=load)


def ids(placement: object) -> list[str]:
    return [c.id for c in placement.candidates]  # type: ignore[attr-defined]


TIGHT = BalanceGuard(relative=1.5, absolute=2)


def test_goes_where_the_adapter_is_loaded_while_that_replica_is_within_the_guard() -> None:
    fleet = [replica("r0", 3), replica("r1", 0)]
    slots = {"r0": slots_of(2, frozenset({"a"})), "r1": slots_of(2)}
    placement = place("a", fleet, slots, guard=TIGHT)
    # 3 <= 1.5 * 0 + 2 fails: r0 is too busy, so r1 (free slot) loads it
    assert (ids(placement), placement.reason) == (["r1"], "free_slot")
    fleet = [replica("r0", 2), replica("r1", 0)]
    placement = place("a", fleet, slots, guard=TIGHT)
    assert (ids(placement), placement.reason) == (["r0"], "loaded")
    assert not placement.loads


def test_every_replica_holding_it_and_within_the_guard_is_offered_to_the_policy() -> None:
    fleet = [replica("r0", 4), replica("r1", 3), replica("r2", 0)]
    slots = {
        "r0": slots_of(2, frozenset({"a"})),
        "r1": slots_of(2, frozenset({"a"})),
        "r2": slots_of(2, frozenset({"b", "c"}), busy=frozenset({"b", "c"})),
    }
    # limit 1.5 * 0 + 2 = 2: neither holder is within it; r2 has no free slot and nothing idle
    assert (ids(place("a", fleet, slots, guard=TIGHT)), place("a", fleet, slots, guard=TIGHT).reason) == (
        ["r0", "r1"],
        "loaded_busy",
    )
    fleet = [replica("r0", 4), replica("r1", 3), replica("r2", 2)]  # limit 5: both holders are within
    assert ids(place("a", fleet, slots, guard=TIGHT)) == ["r0", "r1"]


def test_not_loaded_anywhere_loads_on_the_least_loaded_replica_with_a_free_slot() -> None:
    fleet = [replica("r0", 0), replica("r1", 1), replica("r2", 5)]
    slots = {
        "r0": slots_of(1, frozenset({"x"})),  # full
        "r1": slots_of(2, frozenset({"y"})),
        "r2": slots_of(2),
    }
    placement = place("a", fleet, slots)
    assert (ids(placement), placement.reason, placement.loads) == (["r1"], "free_slot", True)


def test_ties_go_to_the_replica_holding_fewer_adapters() -> None:
    fleet = [replica("r0"), replica("r1")]
    slots = {"r0": slots_of(2, frozenset({"x"})), "r1": slots_of(2)}
    assert ids(place("a", fleet, slots)) == ["r1"]


def test_no_free_slot_evicts_where_the_least_recently_used_adapter_is_idle() -> None:
    fleet = [replica("r0", 0), replica("r1", 1)]
    slots = {
        "r0": slots_of(2, frozenset({"x", "y"}), busy=frozenset({"x", "y"})),
        "r1": slots_of(2, frozenset({"x", "z"}), busy=frozenset({"x"}), last_used={"x": 5.0, "z": 1.0}),
    }
    placement = place("a", fleet, slots)
    assert (ids(placement), placement.reason) == (["r1"], "evict")
    assert plan_load("a", slots["r1"]) == LoadPlan(load=True, evict="z")


def test_least_recently_used_idle_adapter_is_the_one_unloaded() -> None:
    slots = slots_of(3, frozenset({"x", "y", "z"}), busy=frozenset({"x"}), last_used={"x": 0, "y": 9, "z": 4})
    assert slots.idle_victim() == "z"
    assert plan_load("a", slots).evict == "z"
    assert plan_load("x", slots) == LoadPlan(load=False)
    assert plan_load("a", slots_of(4, frozenset({"x"}))) == LoadPlan(load=True)


def test_every_slot_busy_everywhere_waits_or_goes_over_the_bound_where_it_cannot_wait() -> None:
    fleet = [replica("r0", 2), replica("r1", 1)]
    busy = {
        "r0": slots_of(1, frozenset({"x"}), busy=frozenset({"x"})),
        "r1": slots_of(1, frozenset({"y"}), busy=frozenset({"y"})),
    }
    waiting = place("a", fleet, busy, can_wait=True)
    assert (ids(waiting), waiting.reason) == ([], "full")
    over = place("a", fleet, busy, can_wait=False)
    assert (ids(over), over.reason, over.loads) == (["r1"], "over_bound", True)
    assert plan_load("a", busy["r1"]) == LoadPlan(load=True, evict=None)


def test_replicas_without_lora_never_load_adapters() -> None:
    fleet = [replica("r0"), replica("r1")]
    assert place("a", fleet, {"r0": slots_of(0), "r1": slots_of(0)}, can_wait=False).candidates == ()


def test_a_hot_adapter_spreads_once_its_replica_is_busier_than_the_guard_allows() -> None:
    """Requests of one adapter, each staying in flight: the first load goes to one replica; once it is
    more than 1.5x + 2 busier than the other, the other loads the adapter too, then both share it."""
    load = {"r0": 0, "r1": 0}
    slots = {"r0": slots_of(2), "r1": slots_of(2)}
    for _ in range(20):
        fleet = [replica(rid, n) for rid, n in load.items()]
        placement = place("hot", fleet, slots)
        chosen = min(placement.candidates, key=lambda c: (c.load, c.id))  # least loaded, as the policy does
        if placement.loads:
            s = slots[chosen.id]
            slots[chosen.id] = slots_of(s.max_loras, s.loaded | {"hot"}, s.busy | {"hot"})
        load[chosen.id] += 1
    assert all("hot" in s.loaded for s in slots.values())
    assert load == {"r0": 10, "r1": 10}


def test_affinity_off_offers_every_candidate() -> None:
    fleet = [replica("r0", 5), replica("r1", 0)]
    slots = {"r0": slots_of(2, frozenset({"a"})), "r1": slots_of(2)}
    placement = place("a", fleet, slots, affinity=False)
    assert (ids(placement), placement.reason) == (["r0", "r1"], "blind")


def test_crowded_adapter_spreads_though_its_replica_is_within_the_guard() -> None:
    # 8 in flight: the hot adapter alone keeps r0 as busy as an even share (4 of 8 over 2 replicas).
    fleet = [replica("r0", 5), replica("r1", 3)]
    slots = {
        "r0": slots_of(2, frozenset({"hot", "x"}), frozenset({"hot", "x"}), in_flight={"hot": 4, "x": 1}),
        "r1": slots_of(2, frozenset({"y", "z"}), frozenset({"y"}), {"y": 1.0, "z": 0.5}, {"y": 3}),
    }
    placement = place("hot", fleet, slots)
    assert (ids(placement), placement.reason) == (["r1"], "evict")
    assert plan_load("hot", slots["r1"]).evict == "z"
    # A merely popular adapter (3 of 8) stays where it is; so does the hot one with no room elsewhere.
    popular = {**slots, "r0": slots_of(2, frozenset({"hot", "x"}), in_flight={"hot": 3, "x": 2})}
    assert place("hot", fleet, popular).reason == "loaded"
    no_room = {**slots, "r1": slots_of(2, frozenset({"y", "z"}), frozenset({"y", "z"}), in_flight={"y": 3})}
    assert place("hot", fleet, no_room).reason == "loaded"


def test_under_mixed_traffic_a_hot_adapter_ends_up_on_both_replicas_sharing_it_evenly() -> None:
    """Closed loop, 8 clients: half the requests for one adapter, the rest over 7 others; each step one
    request ends and a new one is placed (least loaded among the candidates, as least_loaded does)."""
    rng = random.Random(7)
    adapters = ["hot"] * 7 + [f"a{i}" for i in range(7)]
    loaded: dict[str, set[str]] = {"r0": set(), "r1": set()}
    used: dict[str, dict[str, float]] = {"r0": {}, "r1": {}}
    running: list[tuple[str, str]] = []
    hot_served = collections.Counter[str]()
    for step in range(2000):
        if len(running) == 8:
            running.pop(rng.randrange(8))
        adapter = rng.choice(adapters)
        in_flight = {rid: collections.Counter(a for r, a in running if r == rid) for rid in loaded}
        slots = {
            rid: slots_of(2, frozenset(loaded[rid]), frozenset(in_flight[rid]), used[rid], dict(in_flight[rid]))
            for rid in loaded
        }
        fleet = [replica(rid, sum(in_flight[rid].values())) for rid in loaded]
        placement = place(adapter, fleet, slots)
        if not placement.candidates:
            continue  # every slot busy: it waits (here: another client's request comes instead)
        chosen = min(placement.candidates, key=lambda c: (c.load, c.id)).id
        plan = plan_load(adapter, slots[chosen])
        if plan.evict:
            loaded[chosen].discard(plan.evict)
        loaded[chosen].add(adapter)
        used[chosen][adapter] = step
        running.append((chosen, adapter))
        if adapter == "hot" and step >= 200:
            hot_served[chosen] += 1
    assert all("hot" in held for held in loaded.values())
    shares = [hot_served[rid] / sum(hot_served.values()) for rid in ("r0", "r1")]
    assert all(1 / 3 <= share <= 2 / 3 for share in shares), shares


def test_by_default_a_replica_keeps_four_adapters_per_batch_slot_and_loads_where_a_batch_has_room() -> None:
    held = AdapterSlots(2, frozenset({"a", "b", "c"}))
    assert held.limit == 8 and held.free
    assert AdapterSlots(2, frozenset("abcdefgh")).free is False
    assert AdapterSlots(2, capacity=3).limit == 3
    # r0 is less loaded, but its batches already mix 2 adapters: a third would wait in vLLM's queue.
    fleet = [replica("r0", 1), replica("r1", 3)]
    slots = {
        "r0": AdapterSlots(2, frozenset({"x", "y"}), busy=frozenset({"x", "y"})),
        "r1": AdapterSlots(2, frozenset({"z"}), busy=frozenset({"z"})),
    }
    assert ids(place("a", fleet, slots)) == ["r1"]


def test_a_holder_only_full_for_now_is_waited_for_rather_than_loading_elsewhere() -> None:
    fleet = [replica("r0", 4), replica("r1", 2)]  # r0 holds it, at its capacity: only r1 has room now
    slots = {"r0": AdapterSlots(2, frozenset({"a"})), "r1": AdapterSlots(2)}
    waiting = place("a", fleet[1:], slots, fleet=fleet)
    assert (ids(waiting), waiting.reason) == ([], "holder_full")
    # Where requests cannot wait (no flow control, no queue) it is loaded where there is room.
    assert ids(place("a", fleet[1:], slots, can_wait=False, fleet=fleet)) == ["r1"]
    # Past the guard it is not worth waiting for: r1 loads it.
    busy = [replica("r0", 12), replica("r1", 2)]
    assert ids(place("a", busy[1:], slots, fleet=busy)) == ["r1"]
