"""Flow control's pure parts: the fair queue's order, learned capacity, tenants and priorities, the
admission queue's classes and shedding, the body fields the router adds. No sockets."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import orjson
import pytest

from dpserve.policies.base import ReplicaSnapshot, RequestFeatures
from dpserve.replicas.capacity import PROBE_AFTER, Capacity, learn
from dpserve.router.flow.admission import URGENT_MEMORY_S, Admission, Rejected
from dpserve.router.flow.fair_queue import FairQueue
from dpserve.router.flow.gate import Flow, completion_tokens_guess, with_fields
from dpserve.router.flow.quotas import QuotaBook
from dpserve.router.flow.tenants import (
    ANONYMOUS,
    Caller,
    Priority,
    Tenant,
    TenantRules,
    Tenants,
    parse_tenant_rules,
    split_named_key,
)
from dpserve.router.flow.usage import UsageBook
from dpserve.router.http.errors import OpenAIError

CRITICAL, STANDARD, BATCH = int(Priority.CRITICAL), int(Priority.STANDARD), int(Priority.BATCH)


# --- the fair queue ---------------------------------------------------------------------------------


def drain(queue: FairQueue[str], cost: dict[str, float]) -> list[str]:
    """Releases everything in order, charging each tenant its request's cost as it goes."""
    order = []
    while (item := queue.peek()) is not None:
        queue.remove(item)
        tenant = item.split("-")[0]
        queue.charge(tenant, cost.get(tenant, 1.0))
        order.append(item)
    return order


def test_a_light_tenant_is_not_stuck_behind_a_heavy_tenants_backlog() -> None:
    queue: FairQueue[str] = FairQueue()
    for n in range(20):
        queue.push(f"A-{n}", STANDARD, "A")
    queue.push("B-0", STANDARD, "B")
    order = drain(queue, {"A": 100, "B": 100})
    # FCFS would release B last (21st); by tokens served it goes at most second.
    assert order.index("B-0") <= 1


def test_tenants_share_by_tokens_not_by_requests() -> None:
    queue: FairQueue[str] = FairQueue()
    for n in range(30):
        queue.push(f"A-{n}", STANDARD, "A")  # A's requests cost 3 times B's
        queue.push(f"B-{n}", STANDARD, "B")
    order = drain(queue, {"A": 300, "B": 100})[:40]
    a, b = sum(x.startswith("A") for x in order), sum(x.startswith("B") for x in order)
    assert 3 * a * 300 == pytest.approx(b * 100 * 3, rel=0.15)  # equal tokens, so B gets ~3x the requests


def test_weights_scale_the_share() -> None:
    queue: FairQueue[str] = FairQueue()
    for n in range(40):
        queue.push(f"A-{n}", STANDARD, "A")
        queue.push(f"B-{n}", STANDARD, "B")
    order = []
    while len(order) < 30 and (item := queue.peek()) is not None:
        queue.remove(item)
        tenant = item.split("-")[0]
        queue.charge(tenant, 10.0, weight=2.0 if tenant == "A" else 1.0)
        order.append(tenant)
    assert order.count("A") == pytest.approx(2 * order.count("B"), abs=2)


def test_classes_go_strictly_first_and_fifo_within_a_tenant() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("A-0", BATCH, "A")
    queue.push("B-0", STANDARD, "B")
    queue.push("B-1", STANDARD, "B")
    queue.push("C-0", CRITICAL, "C")
    assert drain(queue, {}) == ["C-0", "B-0", "B-1", "A-0"]


def test_within_a_tenant_and_class_requests_with_an_slo_go_before_best_effort() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("best-0", STANDARD, "A")
    queue.push("slo-0", STANDARD, "A", promised=True)
    queue.push("best-1", STANDARD, "A")
    queue.push("slo-1", STANDARD, "A", promised=True)
    queue.push("batch-slo", BATCH, "A", promised=True)  # a promise does not cross classes
    queue.remove("slo-0")
    queue.push("slo-2", STANDARD, "A", promised=True)
    assert queue.promised_before(STANDARD) == 2  # slo-1, slo-2: the best effort waits behind a newcomer
    assert queue.promised_before(BATCH) == 5  # every standard one, and its class's promised one
    assert queue.promised_before(CRITICAL) == 0
    assert drain(queue, {}) == ["slo-1", "slo-2", "best-0", "best-1", "batch-slo"]


def test_an_idle_tenant_cannot_bank_credit() -> None:
    queue: FairQueue[str] = FairQueue()
    # A is served a lot while nobody waits; B was served little long ago.
    queue.charge("B", 10)
    for _ in range(50):
        queue.charge("A", 100)
    for n in range(10):
        queue.push(f"A-{n}", STANDARD, "A")
    for n in range(10):
        queue.push(f"B-{n}", STANDARD, "B")
    order = [item[0] for item in drain(queue, {"A": 100, "B": 100})[:10]]
    # Raised to A's counter on joining, B alternates with A instead of taking all 10 slots first.
    assert 3 <= order.count("B") <= 7


def test_a_light_tenant_that_ties_with_a_heavy_backlog_goes_first() -> None:
    queue: FairQueue[str] = FairQueue()
    for n in range(3):
        queue.push(f"A-{n}", STANDARD, "A")
    queue.push("B-0", STANDARD, "B")  # joins at A's counter: a tie, and B's backlog is the shorter
    assert queue.counter("A") == queue.counter("B") and queue.peek() == "B-0"
    assert queue.goes_first(STANDARD, "C") is False  # a third ties with B's backlog of one: B began first
    queue.remove("B-0")
    assert queue.goes_first(STANDARD, "C") and queue.peek() == "A-0"


def test_a_newcomer_goes_first_only_when_nothing_waiting_ranks_before_it() -> None:
    queue: FairQueue[str] = FairQueue()
    assert queue.goes_first(STANDARD, "A")
    queue.push("A-0", BATCH, "A")
    assert queue.goes_first(STANDARD, "B") and queue.goes_first(CRITICAL, "B")
    assert not queue.goes_first(BATCH, "A")  # behind its own earlier request
    queue.push("B-0", STANDARD, "B")
    assert not queue.goes_first(BATCH, "C") and not queue.goes_first(STANDARD, "B")
    queue.charge("B", 1000)
    assert queue.goes_first(STANDARD, "C")  # C joins at B's counter... and B has been served more since


def test_the_one_shed_is_the_newest_of_the_least_urgent_class() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("A-0", BATCH, "A")
    queue.push("A-1", BATCH, "A")
    queue.push("B-0", STANDARD, "B")
    assert queue.newest_of_lowest_class(below=STANDARD) == "A-1"
    assert queue.newest_of_lowest_class(below=BATCH) is None  # nothing less urgent than batch


def test_idle_tenants_counters_stay_bounded() -> None:
    queue: FairQueue[str] = FairQueue(max_idle_tenants=100)
    for n in range(10_000):
        tenant = f"t{n}"
        queue.push(tenant, STANDARD, tenant)
        queue.remove(tenant)
        queue.charge(tenant, float(n % 7))
    assert len(queue._counters) <= 101


# --- learned capacity -------------------------------------------------------------------------------


def test_capacity_is_what_runs_once_requests_wait_twice_in_a_row() -> None:
    state = learn(Capacity(), running=4, waiting=30, kv_usage=0.2, occupancy=34)
    assert state.limit == 0  # one scrape may catch a burst the scheduler has not taken in yet
    state = learn(state, running=4, waiting=28, kv_usage=0.2, occupancy=32)
    assert state.limit == 4 and state.confirmed == 4


def test_capacity_is_probed_upward_while_full_with_none_waiting_but_not_with_a_full_cache() -> None:
    full = learn(learn(Capacity(), 32, 3, 0.5, 40), 32, 3, 0.5, 40)
    probed = full
    for _ in range(PROBE_AFTER - 1):
        probed = learn(probed, running=32, waiting=0, kv_usage=0.5, occupancy=32)
    assert probed.limit == 32  # not yet: a moment at capacity says little
    probed = learn(probed, running=32, waiting=0, kv_usage=0.5, occupancy=32)
    assert probed.limit == 34 and probed.confirmed == 32  # a sixteenth more, tried; 32 still what was seen
    nearly_full = full
    for _ in range(PROBE_AFTER):
        nearly_full = learn(nearly_full, running=32, waiting=0, kv_usage=0.95, occupancy=32)
    assert nearly_full.limit == 32
    assert learn(full, running=10, waiting=0, kv_usage=0.1, occupancy=10).limit == 32  # not full: no news
    ran_more = learn(probed, running=34, waiting=0, kv_usage=0.5, occupancy=34)
    assert ran_more.confirmed == 34  # it ran them all: that many at once
    assert learn(probed, 32, 2, 0.5, 34).limit == 32  # the one tried waited: back at once
    assert learn(Capacity(), running=10, waiting=0, kv_usage=0.1, occupancy=10).limit == 0  # never seen full


def test_a_scrape_between_one_request_ending_and_the_next_starting_does_not_shrink_the_capacity() -> None:
    state = Capacity()
    for running in (4, 4, 3, 4, 3):  # some scrapes land in the gap between two requests
        state = learn(state, running=running, waiting=1, kv_usage=0.3, occupancy=5)
    assert state.limit == 4
    for _ in range(4):  # lower for as long as it is remembered: it has shrunk (a fuller KV cache, say)
        state = learn(state, running=3, waiting=2, kv_usage=0.95, occupancy=5)
    assert state.limit == 3


# --- tenants ------------------------------------------------------------------------------------------


def test_slots_idle_between_requests_are_learned_where_the_router_keeps_a_replica_full() -> None:
    capacity = learn(learn(Capacity(), 4, 3, 0.1, 4), 4, 3, 0.1, 4)
    assert capacity.limit == 4 and not capacity.slow_refill
    cpu = fast = capacity
    for _ in range(30):
        # Full as the router sees it, nothing waiting: on a CPU replica one slot in six is a request in transit.
        cpu = learn(cpu, 3, 0, 0.1, 4) if _ % 2 else learn(cpu, 4, 0, 0.1, 4)
        fast = learn(fast, 4, 0, 0.1, 4)
    assert cpu.slow_refill and 0.05 < cpu.idle < 0.25 and not fast.slow_refill and fast.idle == 0
    # One scrape that catches a request in transit on an otherwise prompt replica is not enough.
    caught = learn(fast, fast.limit - 1, 0, 0.1, fast.limit)
    assert 0 < caught.idle and not caught.slow_refill
    # While a request waits in the engine nothing idles there: the mean holds rather than falls.
    assert learn(cpu, 4, 1, 0.1, 5).idle == cpu.idle
    # Not full as the router sees it (nothing to send): idle slots say nothing.
    assert learn(fast, 1, 0, 0.1, 1).idle == 0


def test_tenant_rules_parse_and_bad_ones_say_why() -> None:
    name, rules = parse_tenant_rules("acme:weight=2,priority=batch,rpm=60,tpm=1000,concurrent=4,trusted=true")
    assert name == "acme" and rules.weight == 2 and rules.priority is Priority.BATCH and rules.trusted
    assert (rules.quota.requests_per_min, rules.quota.tokens_per_min, rules.quota.concurrent) == (60, 1000, 4)
    assert rules.max_priority is Priority.CRITICAL  # no ceiling given: it may ask for any class
    for bad in (
        "acme:priority=critical,max-priority=standard",
        "acme:weight=0",
        "acme:priority=urgent",
        "acme:color=red",
        "acme:rpm",
        "bad name:rpm=1",
        "x:tpm=-1",
    ):
        with pytest.raises(ValueError, match="--tenant"):
            parse_tenant_rules(bad)


def test_named_and_bare_keys() -> None:
    assert split_named_key("acme:sk-123456") == ("acme", "sk-123456")
    name, key = split_named_key("sk-123456")
    assert key == "sk-123456" and name.startswith("key-") and "123456" not in name


def test_who_may_name_a_tenant_and_how_priority_is_capped() -> None:
    rules = {"gw": TenantRules(trusted=True), "acme": TenantRules(max_priority=Priority.STANDARD)}
    tenants = Tenants(rules, open_access=False)
    assert tenants.identify(Caller("acme", False), {}).name == "acme"
    with pytest.raises(OpenAIError) as refused:
        tenants.identify(Caller("acme", False), {"x-dpserve-tenant": "other"})
    assert refused.value.status == 403
    assert tenants.identify(Caller("gw", False), {"x-dpserve-tenant": "team-1"}).name == "team-1"
    with pytest.raises(OpenAIError) as bad:
        tenants.identify(Caller("gw", False), {"x-dpserve-tenant": "no spaces"})
    assert bad.value.status == 400
    capped = tenants.identify(Caller("acme", False), {"x-dpserve-priority": "critical"})
    assert capped.priority is Priority.STANDARD
    with pytest.raises(OpenAIError) as unknown:
        tenants.identify(Caller("acme", False), {"x-dpserve-priority": "asap"})
    assert unknown.value.status == 400
    anyone = Tenants({}, open_access=True)
    assert anyone.identify(None, {}).name == ANONYMOUS
    assert anyone.identify(None, {"x-dpserve-tenant": "B"}).name == "B"


def test_a_tenant_is_made_once_per_name_and_class_and_named_ones_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rules = {"acme": TenantRules(priority=Priority.BATCH), "gw": TenantRules(trusted=True)}
    tenants = Tenants(rules, open_access=False)
    plain = tenants.identify(Caller("acme", False), {})
    assert plain is tenants.identify(Caller("acme", False), {}) and plain.priority is Priority.BATCH
    urgent = tenants.identify(Caller("acme", False), {"x-dpserve-priority": "critical"})
    assert urgent.priority is Priority.CRITICAL and urgent.rules is plain.rules
    assert urgent is tenants.identify(Caller("acme", False), {"x-dpserve-priority": "critical"})
    # Names from a trusted header are not bounded: the made ones are forgotten past MADE_TENANTS.
    monkeypatch.setattr("dpserve.router.flow.tenants.MADE_TENANTS", 3)
    named = [tenants.identify(Caller("gw", False), {"x-dpserve-tenant": f"t{n}"}) for n in range(10)]
    assert [t.name for t in named] == [f"t{n}" for n in range(10)]
    assert len(tenants._made) <= 3
    assert tenants.identify(Caller("gw", False), {"x-dpserve-tenant": "t9"}) is named[9]


# --- the admission queue ----------------------------------------------------------------------------


def replica(rid: str, in_flight: int, capacity: int = 0) -> ReplicaSnapshot:
    return ReplicaSnapshot(id=rid, in_flight=in_flight, capacity=capacity)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_learned_capacity_bounds_a_replica_and_batch_leaves_a_reserve_while_others_come() -> None:
    clock = Clock()
    admission = Admission(0, 16, 1.0, clock, flow_control=True, batch_reserve=0.25)
    assert admission.has_room(replica("r0", 7, capacity=8))
    assert not admission.has_room(replica("r0", 8, capacity=8))
    # Only batch so far: batch goes as far as the others.
    assert admission.has_room(replica("r0", 7, capacity=8), BATCH)
    await admission.wait_for_room(lambda: True, STANDARD, "A")  # a more urgent request came
    assert not admission.has_room(replica("r0", 6, capacity=8), BATCH)  # 2 of 8 slots kept for others
    assert admission.has_room(replica("r0", 5, capacity=8), BATCH)
    # The reserve is of what the replica was seen to run, not of one more being tried.
    assert not admission.has_room(ReplicaSnapshot("r0", in_flight=6, capacity=9, confirmed_capacity=8), BATCH)
    assert admission.has_room(replica("r0", 0, capacity=1), BATCH)  # never its last slot
    clock.now += URGENT_MEMORY_S + 1
    assert admission.has_room(replica("r0", 7, capacity=8), BATCH)  # none for a while: the reserve is released
    assert admission.has_room(replica("r0", 500))  # capacity not known yet: no bound
    off = Admission(0, 16, 1.0, flow_control=False)
    assert not off.holds and off.has_room(replica("r0", 8, capacity=8))


def test_best_effort_leaves_a_reserve_to_requests_with_an_slo_while_they_come() -> None:
    clock = Clock()
    admission = Admission(0, 16, 1.0, clock, flow_control=True, slo_reserve=0.25)
    full_but_two = [replica("r0", 6, capacity=8)]
    assert admission.open(full_but_two) == full_but_two  # no SLO seen yet: best effort takes every slot
    for _ in range(300):  # half the requests come with an SLO: their share, up to the 0.25 at most
        admission.arrived(promised=True)
        admission.arrived(promised=False)
    assert admission.open(full_but_two, promised=True) == full_but_two
    assert admission.open(full_but_two) == []  # best effort leaves 2 of 8 slots to such requests
    assert admission.has_room(replica("r0", 5, capacity=8))
    assert not admission.has_room(replica("r0", 6, capacity=8))
    assert admission.has_room(replica("r0", 7, capacity=8), promised=True)
    assert admission.has_room(replica("r0", 0, capacity=1))  # never its last slot
    for _ in range(300):  # then one in 20: a share of 0.05, one slot of 8
        admission.arrived(promised=_ % 20 == 0)
    assert admission.has_room(replica("r0", 6, capacity=8)) and not admission.has_room(replica("r0", 7, capacity=8))
    clock.now += URGENT_MEMORY_S + 1
    assert admission.open(full_but_two) == full_but_two  # none for a while: the reserve is released


async def test_a_request_with_room_is_admitted_at_once_only_while_nobody_waits() -> None:
    clock = Clock()
    admission = Admission(0, 16, 1.0, clock, flow_control=True, batch_reserve=0.25)
    assert admission.admit_at_once(STANDARD, "A", 2.0, 100.0)
    # Charged as wait_for_room charges (tokens over weight), and a more urgent request is remembered.
    assert admission._queue.counter("A") == 50.0
    assert not admission.has_room(replica("r0", 6, capacity=8), BATCH)
    # Once one waits, a newcomer must queue behind it (wait_for_room decides who goes first).
    room = [False]
    waiting = asyncio.create_task(admission.wait_for_room(lambda: room[0], STANDARD, "B", cost=10.0))
    await asyncio.sleep(0.01)
    assert admission.depth == 1 and not admission.admit_at_once(STANDARD, "C", 1.0, 10.0)
    assert admission._queue.counter("C") == 0.0  # not charged: it was not admitted
    room[0] = True
    admission.notify()
    await waiting
    assert admission.depth == 0 and admission.admit_at_once(BATCH, "C", 1.0, 10.0)
    off = Admission(0, 16, 1.0, flow_control=False)
    assert off.admit_at_once(STANDARD, "A", 1.0, 100.0) and off._queue.counter("A") == 0.0


async def test_held_requests_go_by_class_then_fair_share() -> None:
    admission = Admission(0, 64, 5.0, flow_control=True)
    slots = [0]
    order: list[str] = []

    async def request(name: str, priority: int, tenant: str) -> None:
        await admission.wait_for_room(lambda: slots[0] > 0, priority, tenant, cost=100.0)
        slots[0] -= 1
        order.append(name)

    tasks = [asyncio.create_task(request(f"A{n}", STANDARD, "A")) for n in range(6)]
    await asyncio.sleep(0.01)
    tasks += [asyncio.create_task(request("B0", STANDARD, "B")), asyncio.create_task(request("Z0", BATCH, "Z"))]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(request("C0", CRITICAL, "C")))
    await asyncio.sleep(0.01)
    for _ in range(len(tasks)):
        slots[0] += 1
        admission.notify()
        await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    assert order[0] == "C0" and order.index("B0") <= 2 and order[-1] == "Z0"


async def test_one_tenant_alone_keeps_a_request_waiting_in_the_engine_but_not_while_another_tenant_waits() -> None:
    admission = Admission(0, 64, 5.0, flow_control=True, engine_queue=1)
    # Full, and its slots were seen idle while requests were on their way to it.
    fleet = [ReplicaSnapshot("r0", in_flight=4, capacity=4, slow_refill=True)]

    def has_room() -> bool:
        return bool(admission.open(fleet))

    order: list[str] = []

    async def request(tenant: str) -> None:
        await admission.wait_for_room(has_room, STANDARD, tenant, cost=10.0)
        fleet[0] = replace(fleet[0], in_flight=fleet[0].in_flight + 1)
        order.append(tenant)

    def end_one() -> None:
        fleet[0] = replace(fleet[0], in_flight=fleet[0].in_flight - 1)
        admission.notify()

    # A alone: one more than the capacity goes on, to wait in the engine; the next waits in the router.
    first = asyncio.create_task(request("A"))
    await asyncio.sleep(0.01)
    assert first.done() and fleet[0].in_flight == 5
    behind = asyncio.create_task(request("A"))
    await asyncio.sleep(0.01)
    assert not behind.done() and admission.depth == 1
    # B comes (joining at A's counter, so behind A's older request): while both wait, nothing goes past
    # the capacity, so B is never stuck behind more of A's requests in the engine.
    light = asyncio.create_task(request("B"))
    await asyncio.sleep(0.01)
    end_one()  # the engine starts A's waiting request: still no free slot
    await asyncio.sleep(0.01)
    assert not light.done() and not behind.done() and fleet[0].in_flight == 4
    end_one()  # a slot is free: A's older request; then B waits alone, first in line for the next slot
    await asyncio.sleep(0.01)
    assert light.done() and behind.done() and fleet[0].in_flight == 5 and order == ["A", "A", "B"]
    # A newcomer never goes past the capacity on its own: only as the first of its tenant's waiters.
    fleet[0] = replace(fleet[0], in_flight=4)
    assert not admission.open(fleet) and admission.depth == 0
    # Nor with --engine-queue 0, nor on a replica whose slots refill promptly from the router.
    none = Admission(0, 64, 5.0, flow_control=True, engine_queue=0)
    prompt = [replace(fleet[0], slow_refill=False)]
    waiting = [
        asyncio.create_task(none.wait_for_room(lambda: bool(none.open(fleet)), STANDARD, "A")),
        asyncio.create_task(admission.wait_for_room(lambda: bool(admission.open(prompt)), STANDARD, "A")),
    ]
    await asyncio.sleep(0.01)
    assert not any(task.done() for task in waiting)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_full_queue_sheds_a_batch_request_for_a_more_urgent_one() -> None:
    admission = Admission(0, 2, 5.0, flow_control=True)
    batch = [asyncio.create_task(admission.wait_for_room(lambda: False, BATCH, "Z")) for _ in range(2)]
    await asyncio.sleep(0.01)
    urgent = asyncio.create_task(admission.wait_for_room(lambda: False, STANDARD, "A"))
    await asyncio.sleep(0.01)
    shed = [task for task in batch if task.done()]
    assert len(shed) == 1
    error = shed[0].exception()
    assert isinstance(error, Rejected) and error.code == "shed" and error.headers["retry-after"]
    with pytest.raises(Rejected) as full:  # another batch request is refused outright: nothing to shed for it
        await admission.wait_for_room(lambda: False, BATCH, "Z")
    assert full.value.code == "queue_full"
    for task in [*batch, urgent]:
        task.cancel()
    await asyncio.gather(*batch, urgent, return_exceptions=True)
    assert admission.depth == 0


# --- what the router adds to a body ------------------------------------------------------------------


def test_fields_are_spliced_in_without_serializing_the_body_again() -> None:
    raw = b'{"model": "m",  "prompt": "hi", "stream": true}'
    payload = orjson.loads(raw)
    spliced = with_fields(raw, payload, {"stream_options": {"include_usage": True}, "priority": 1})
    assert spliced.endswith(b'"model": "m",  "prompt": "hi", "stream": true}')  # the client's bytes kept
    assert orjson.loads(spliced) == {**payload, "stream_options": {"include_usage": True}, "priority": 1}
    replaced = with_fields(raw, payload, {"model": "other"})
    assert orjson.loads(replaced) == {**payload, "model": "other"}
    assert with_fields(raw, payload, {}) is raw


def test_an_answer_is_guessed_at_its_max_tokens_up_to_a_bound() -> None:
    assert completion_tokens_guess({"max_tokens": 16}) == 16
    assert completion_tokens_guess({"max_tokens": 100_000}) == completion_tokens_guess({})
    assert completion_tokens_guess({"max_tokens": True}) == completion_tokens_guess({})


def test_features_default_to_standard_priority() -> None:
    assert RequestFeatures("chat", "m", False).priority == STANDARD


def test_the_class_goes_to_vllm_only_when_asked() -> None:
    tenants = Tenants({}, open_access=True)
    batch = Tenant("t", TenantRules(), Priority.BATCH)
    passing = Flow(tenants, QuotaBook(), UsageBook(), Admission(0, 1, 1.0), pass_priority=True)
    assert passing.upstream_fields(batch) == {"priority": 2}
    assert passing.upstream_fields(batch, slo_bound=True) == {"priority": 1}
    critical = Tenant("t", TenantRules(), Priority.CRITICAL)
    assert passing.upstream_fields(critical) == {"priority": -2}
    assert passing.upstream_fields(critical, slo_bound=True) == {"priority": -3}
    assert Flow(tenants, QuotaBook(), UsageBook(), Admission(0, 1, 1.0)).upstream_fields(batch) == {}
