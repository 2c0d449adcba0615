"""Admission control: per-replica limit, FIFO queue, full queue and timeout as 429; no sockets."""

from __future__ import annotations

import asyncio

import pytest

from dpserve.policies.base import ReplicaSnapshot
from dpserve.router.flow.admission import RECHECK_S, Admission, Rejected


def snapshot(rid: str, in_flight: int) -> ReplicaSnapshot:
    return ReplicaSnapshot(id=rid, in_flight=in_flight, running=0, waiting=0, in_flight_at_scrape=0, kv_usage=0.0)


def test_open_keeps_only_replicas_under_the_limit() -> None:
    admission = Admission(limit_per_replica=2, queue_size=4, timeout_s=1.0)
    open_ = admission.open([snapshot("r0", 2), snapshot("r1", 1)])
    assert [c.id for c in open_] == ["r1"]
    assert len(Admission(0, 4, 1.0).open([snapshot("r0", 10_000)])) == 1  # 0: no limit


async def test_room_at_once_means_no_wait() -> None:
    admission = Admission(1, 4, 1.0)
    assert await admission.wait_for_room(lambda: True) == 0.0 and admission.depth == 0


async def test_waiters_are_admitted_in_arrival_order_as_slots_free() -> None:
    admission = Admission(1, 8, 5.0)
    slots = [0]
    order: list[int] = []

    async def request(number: int) -> None:
        await admission.wait_for_room(lambda: slots[0] > 0)
        slots[0] -= 1
        order.append(number)

    tasks = [asyncio.create_task(request(n)) for n in range(5)]
    await asyncio.sleep(0.01)
    assert admission.depth == 5 and not order
    for expected in range(1, 6):
        slots[0] += 1
        admission.notify()
        await asyncio.sleep(0.01)
        assert len(order) == expected
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4] and admission.depth == 0


async def test_the_expected_wait_is_learned_from_the_waits_of_requests_with_an_slo() -> None:
    now = [100.0]
    admission = Admission(1, 8, 30.0, clock=lambda: now[0], flow_control=True)
    prior = admission.expected_wait_s(1)
    assert prior == pytest.approx(0.1)  # the prior: until the first slot frees
    slots = [0]

    async def request(promised: bool) -> None:
        await admission.wait_for_room(lambda: slots[0] > 0, within_s=5.0 if promised else None, promised=promised)
        slots[0] -= 1

    for _ in range(30):  # each with an SLO waits 1 s, alone, though best effort waits behind it
        tasks = [asyncio.create_task(request(promised)) for promised in (False, True)]
        await asyncio.sleep(0)
        now[0] += 1.0
        slots[0] += 2
        admission.notify()
        await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
    assert admission.expected_wait_s(1) == pytest.approx(1.0, rel=0.1)
    # The chance a wait predicted at 1 s ends sooner: the recent waits' ratios to their predictions say.
    assert admission.wait_chance(1.0, 1.5) > 0.9 and admission.wait_chance(1.0, 0.5) < 0.1
    assert Admission(1, 8, 30.0).wait_chance(0.1, 10.0) == 0.0  # no wait seen: no chance claimed


async def test_a_newcomer_does_not_jump_the_queue() -> None:
    admission = Admission(1, 8, 5.0)
    room = [False]
    first = asyncio.create_task(admission.wait_for_room(lambda: room[0]))
    await asyncio.sleep(0.01)
    room[0] = True  # room appears, but the head has not been woken yet
    second = asyncio.create_task(admission.wait_for_room(lambda: room[0]))
    await asyncio.sleep(0.01)
    assert not second.done()
    admission.notify()
    await asyncio.wait_for(asyncio.gather(first, second), 1.0)


async def test_a_full_queue_is_refused_at_once_with_retry_after() -> None:
    admission = Admission(1, 2, 5.0)
    waiting = [asyncio.create_task(admission.wait_for_room(lambda: False)) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(Rejected) as refused:
        await admission.wait_for_room(lambda: False)
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    assert int(refused.value.headers["retry-after"]) >= 1
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert admission.depth == 0  # cancelled waiters (clients that left) leave the queue


async def test_a_wait_past_the_timeout_is_refused() -> None:
    admission = Admission(1, 4, 0.1)
    with pytest.raises(Rejected) as refused:
        await admission.wait_for_room(lambda: False)
    assert refused.value.code == "queue_timeout" and admission.depth == 0


async def test_a_request_with_a_sooner_deadline_is_refused_at_it_not_after() -> None:
    admission = Admission(1, 4, 5.0)
    started = asyncio.get_running_loop().time()
    with pytest.raises(Rejected) as refused:
        await admission.wait_for_room(lambda: False, within_s=0.1)  # a 100 ms TTFT SLO, a 5 s queue timeout
    waited = asyncio.get_running_loop().time() - started
    assert refused.value.code == "slo_unattainable" and 0.1 <= waited < 0.5
    assert refused.value.headers["retry-after"] == "2" and admission.timeouts == 0 and admission.depth == 0
    with pytest.raises(Rejected) as timed_out:  # a deadline past the queue's own timeout changes nothing
        await Admission(1, 4, 0.05).wait_for_room(lambda: False, within_s=10.0)
    assert timed_out.value.code == "queue_timeout"


async def test_the_first_held_request_looks_again_without_being_told() -> None:
    # Room can come from where no listener hears (load from elsewhere ended): the floor under every wake.
    admission = Admission(1, 4, 5.0)
    room = [False]
    held = asyncio.create_task(admission.wait_for_room(lambda: room[0]))
    await asyncio.sleep(0.01)
    assert admission.depth == 1 and admission.oldest_wait_s() > 0
    room[0] = True  # nobody calls notify()
    waited = await asyncio.wait_for(held, 3 * RECHECK_S)
    assert 0 < waited <= 3 * RECHECK_S and admission.depth == 0 and admission.oldest_wait_s() == 0.0


async def test_a_request_that_waits_past_the_timeout_is_counted() -> None:
    admission = Admission(1, 4, 0.05)
    for _ in range(2):
        with pytest.raises(Rejected):
            await admission.wait_for_room(lambda: False)
    assert admission.timeouts == 2


def test_the_in_flight_cap_counts_the_peers_requests_too() -> None:
    admission = Admission(limit_per_replica=4, queue_size=4, timeout_s=1.0)
    ours_and_peers = ReplicaSnapshot(id="r0", in_flight=1, peer_in_flight=3)
    ours_alone = ReplicaSnapshot(id="r1", in_flight=3, peer_in_flight=0)
    assert [c.id for c in admission.open([ours_and_peers, ours_alone])] == ["r1"]
