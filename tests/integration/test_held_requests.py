"""Held requests against load the router did not send: a capacity-4 `dpserve sim` replica is filled by
clients that do not go through the router under test (straight at the replica, or through a second router
without `--peer`), until the router under test has learned its capacity; then the outside load stops and 6
connections go through the router, at its default settings, for 6 s.

What must hold: the router serves at least 0.8x the replica's capacity-bound rate (measured in the same
test, from the outside load that kept it full), and no request waits in the router while the replica
itself reports room (read from the replica's own /metrics, not from the router)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import pytest

from tests.integration.conftest import running_sim, start_router, stop_router
from tests.integration.traffic import Answer, closed_loop, replica_counts

pytestmark = pytest.mark.integration

CAPACITY = 4
SIM_ARGS = ("--max-num-seqs", str(CAPACITY), "--decode-ms-per-token", "10", "--seed", "5")
OUTSIDE_CONNECTIONS = 8
ROUTED_CONNECTIONS = 6
ROUTED_S = 6.0
DEFAULT_PROBE_INTERVAL = ("--probe-interval", "1.0")
"""The router's default: the test helper's faster probing would hide a stall between two probes."""
LONGEST_HOLD_S = 2.0
"""The longest any request may be seen held (`/status` `oldest_queued_s`) in the routed phase: the outside
load's last requests end within ~0.4 s, then a slot frees every ~0.05 s. Today's code: `--queue-timeout`."""
WAIT_WITH_ROOM_MAX_S = 0.5
"""The longest the router may hold a request while the replica reports room: one held-request scrape
(0.1 s) plus the floor timer and the answers' own round trips, with margin. Today's code held them for
the whole phase."""


@dataclass
class Sample:
    at: float
    queued: int
    oldest_queued_s: float
    running: int
    waiting: int


async def sample_until(router_url: str, replica_url: str, until: float) -> list[Sample]:
    """Every 50 ms: the router's held requests and the replica's own running and waiting counts."""
    samples: list[Sample] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < until:
            async with session.get(f"{router_url}/status") as response:
                flow = (await response.json())["flow"]
            running, waiting = await replica_counts(session, replica_url)
            samples.append(Sample(time.monotonic(), flow["queued"], flow["oldest_queued_s"], running, waiting))
            await asyncio.sleep(0.05)
    return samples


def longest_wait_with_room(samples: list[Sample]) -> float:
    """The longest stretch of consecutive samples in which the router held requests while the replica
    ran fewer than its capacity with none waiting in it."""
    longest, since = 0.0, None
    for sample in samples:
        if sample.queued > 0 and sample.running < CAPACITY and sample.waiting == 0:
            since = sample.at if since is None else since
            longest = max(longest, sample.at - since)
        else:
            since = None
    return longest


async def capacity_learned(router_url: str) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            async with session.get(f"{router_url}/status") as response:
                if (await response.json())["replicas"][0]["capacity"]:
                    return
            await asyncio.sleep(0.1)
    raise AssertionError("the router never learned the replica's capacity from the outside load")


def rate(answers: list[Answer], start: float, end: float) -> float:
    """Answers served (200) that ended in [start, end], per second."""
    return sum(1 for a in answers if a.status == 200 and start <= a.ended <= end) / (end - start)


async def outside_then_routed(outside_url: str, router_url: str, replica_url: str) -> tuple[float, float, float]:
    """Outside load at `outside_url` until the router under test learned the capacity (at least 2 s), then
    the routed phase. The capacity-bound rate (the outside load's, after its first second), the routed
    rate over the routed phase, and the longest wait with room in it."""
    stop = asyncio.Event()
    started = time.monotonic()
    outside = asyncio.create_task(closed_loop(outside_url, "outside", OUTSIDE_CONNECTIONS, started + 60, stop=stop))
    await asyncio.sleep(2.0)
    await capacity_learned(router_url)
    stop.set()  # no new outside requests; those in flight end as they would
    switched = time.monotonic()
    until = switched + ROUTED_S
    routed, samples = await asyncio.gather(
        closed_loop(router_url, "routed", ROUTED_CONNECTIONS, until), sample_until(router_url, replica_url, until)
    )
    outside_answers = await outside
    assert all(a.status == 200 for a in outside_answers + routed), [a for a in routed if a.status != 200][:3]
    capacity_bound = rate(outside_answers, started + 1.0, switched)
    assert capacity_bound > 0, "the outside load served nothing"
    held = [sample.oldest_queued_s for sample in samples if sample.queued]
    # The wait is visible in /status while it lasts, and bounded: a slot frees every service time / 4.
    assert not held or max(held) > 0, "requests were held but /status showed no wait"
    assert max(held, default=0.0) <= LONGEST_HOLD_S, f"a request was held {max(held):.2f} s"
    return capacity_bound, rate(routed, switched, until), longest_wait_with_room(samples)


def check(capacity_bound: float, routed: float, waited_with_room: float) -> None:
    print(f"capacity-bound {capacity_bound:.1f}/s, routed {routed:.1f}/s, held with room {waited_with_room:.2f} s")
    assert routed >= 0.8 * capacity_bound, f"routed {routed:.1f}/s against the replica's {capacity_bound:.1f}/s"
    assert waited_with_room <= WAIT_WITH_ROOM_MAX_S, f"held for {waited_with_room:.2f} s while the replica had room"


@pytest.mark.parametrize("policy", ["least_loaded", "kv_aware"])
def test_held_requests_go_once_outside_load_ends(policy: str) -> None:
    with running_sim(*SIM_ARGS) as sim:
        events = (f"--kv-events={sim.url}={sim.kv_events}", "--tokenizer", "remote") if policy == "kv_aware" else ()
        router = start_router([sim.url], policy, *events, *DEFAULT_PROBE_INTERVAL)
        try:
            check(*asyncio.run(outside_then_routed(sim.url, router.url, sim.url)))
        finally:
            stop_router(router)


def test_held_requests_go_once_another_routers_load_ends() -> None:
    """The other router forwards everything (`--flow-control off`). With its flow control on it learns the
    capacity too and then holds its own excess, so the replica stops showing requests waiting: whether the
    router under test learned the capacity first was then a race of their scrape phases (CI lost it once),
    and a router that never learned it holds nothing, so there is no held request to test."""
    with running_sim(*SIM_ARGS) as sim:
        other = start_router([sim.url], "least_loaded", "--flow-control", "off", *DEFAULT_PROBE_INTERVAL)
        router = start_router([sim.url], "least_loaded", *DEFAULT_PROBE_INTERVAL)
        try:
            check(*asyncio.run(outside_then_routed(other.url, router.url, sim.url)))
        finally:
            stop_router(router)
            stop_router(other)
