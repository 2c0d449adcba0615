"""Chaos: steady load over two simulator replicas, one killed with SIGKILL mid-load and restarted.

No non-streaming request may fail (they are retried before their first byte); a stream cut after its
first byte must end with an SSE error event and `[DONE]`; the replica must be ejected at once and
re-admitted once it is back. The test prints what it saw."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import orjson
import pytest

from dpserve.replicas.prometheus_text import parse_samples
from tests.conftest import free_port
from tests.integration.conftest import (
    answers,
    router_status,
    sim_command,
    start_router,
    stop_process,
    stop_router,
    wait_until,
)

pytestmark = pytest.mark.integration

CLIENTS = 12
LOAD_S = 9.0
KILL_AT_S = 2.5
RESTART_AT_S = 4.5
# 10 ms per token: answers and streams take about 0.6 s, so several are mid-flight when the replica dies.
SIM_ARGS = ("--decode-ms-per-token", "10", "--seed", "1")


@dataclass
class SimSlot:
    """A sim on fixed ports, so it can come back where the router expects it."""

    port: int = field(default_factory=free_port)
    kv_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    def start(self) -> None:
        command = sim_command(self.port, self.kv_events, *SIM_ARGS)
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: answers(f"{self.url}/health"), 30, 0.05, "sim")

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()


@contextlib.contextmanager
def two_sims() -> Iterator[list[SimSlot]]:
    slots = [SimSlot(), SimSlot()]
    try:
        for slot in slots:
            slot.start()
        yield slots
    finally:
        for slot in slots:
            if slot.process is not None and slot.process.poll() is None:
                stop_process(slot.process, 10)


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    served_by_r1_after_readmission: int = 0


async def one_request(client: httpx.AsyncClient, number: int, tally: Tally, readmitted: asyncio.Event) -> None:
    stream = number % 2 == 0
    body = {
        "model": "dpserve-tiny",
        "prompt": f"request {number}: tell me about the sea " * 8,
        # 45-75 tokens (~0.6 s), so at any moment several of both kinds are mid-flight on each replica. The
        # spread keeps the clients out of lockstep: with equal lengths they moved in waves whose routing
        # alternated, which could put every stream on one replica and every answer on the other.
        "max_tokens": 45 + (number * 7) % 31,
        "stream": stream,
    }
    if not stream:
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            tally.failures.append(f"non-streaming {response.status_code}: {response.text[:200]}")
        tally.counts["non_streaming"] += 1
        if readmitted.is_set() and response.headers.get("x-dpserve-replica") == "r1":
            tally.served_by_r1_after_readmission += 1
        return
    events: list[bytes] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            tally.failures.append(f"stream answered {response.status_code}")
            return
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:].encode())
    tally.counts["streaming"] += 1
    if not events or events[-1] != b"[DONE]":
        tally.failures.append(f"stream ended without [DONE] after {len(events)} events")
        return
    errors = [orjson.loads(e)["error"] for e in events[:-1] if e.startswith(b'{"error"')]
    if errors:
        assert errors[0]["code"] == "stream_broken" and len(errors) == 1 and events[-2].startswith(b'{"error"')
        tally.counts["broken_streams"] += 1


async def client_loop(url: str, worker: int, stop_at: float, tally: Tally, readmitted: asyncio.Event) -> None:
    number = worker
    await asyncio.sleep(worker * 0.05)  # staggered starts, for the same reason as the spread of lengths
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while time.monotonic() < stop_at:
            await one_request(client, number, tally, readmitted)
            number += CLIENTS


def r1_healthy(url: str) -> bool:
    return router_status(url)["replicas"][1]["healthy"]


async def poll_until(predicate: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `predicate()` holds, polled every 10 ms off the event loop's hot path."""
    started = time.monotonic()
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() - started < timeout_s, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


@pytest.mark.timeout(120)
async def test_killing_a_replica_under_load_loses_no_request_and_it_is_readmitted() -> None:
    with two_sims() as (sim0, sim1):
        router = start_router(
            [sim0.url, sim1.url],
            "kv_aware",
            "--kv-events",
            f"{sim0.url}={sim0.kv_events}",
            "--kv-events",
            f"{sim1.url}={sim1.kv_events}",
            "--probe-interval",
            "0.2",
            "--gpu-interval",
            "0",
        )
        try:
            tally = Tally()
            readmitted = asyncio.Event()
            started = time.monotonic()
            load = [
                asyncio.create_task(client_loop(router.url, w, started + LOAD_S, tally, readmitted))
                for w in range(CLIENTS)
            ]
            await asyncio.sleep(KILL_AT_S)
            before_kill = router_status(router.url)["replicas"][1]["served_total"]
            sim1.kill()
            ejection_s = await poll_until(lambda: not r1_healthy(router.url), 10)
            await asyncio.sleep(max(0.0, started + RESTART_AT_S - time.monotonic()))
            restarted = time.monotonic()
            await asyncio.to_thread(sim1.start)
            readmission_s = await poll_until(lambda: r1_healthy(router.url), 10)
            readmitted.set()
            readmitted_after = time.monotonic() - restarted
            await asyncio.gather(*load)
            status = router_status(router.url)
            async with httpx.AsyncClient() as client:
                text = (await client.get(f"{router.url}/metrics")).text
            metrics = parse_samples(text, ("dpserve_retries_total", "dpserve_broken_streams_total"))
        finally:
            stop_router(router)
    retried = metrics.total("dpserve_retries_total") or 0
    broken = metrics.total("dpserve_broken_streams_total") or 0
    print(
        f"\nchaos: {tally.counts['non_streaming']} non-streaming + {tally.counts['streaming']} streaming requests "
        f"over {LOAD_S:g} s with {CLIENTS} clients; r1 SIGKILLed at {KILL_AT_S:g} s after {before_kill} requests\n"
        f"chaos: retried {retried:g} (before the first byte), broken streams {tally.counts['broken_streams']} "
        f"(router counted {broken:g}), failures {len(tally.failures)}\n"
        f"chaos: ejected {ejection_s * 1000:.0f} ms after the kill; re-admitted {readmitted_after * 1000:.0f} ms "
        f"after the restart (the last {readmission_s * 1000:.0f} ms of it waiting on probes); "
        f"{tally.served_by_r1_after_readmission} non-streaming requests served by r1 after that"
    )
    assert not tally.failures, tally.failures[:5]
    assert tally.counts["non_streaming"] > 50 and tally.counts["streaming"] > 50
    assert retried >= 1, "the kill should have caught requests before their first byte"
    assert tally.counts["broken_streams"] == broken and broken >= 1, "the kill should have cut streams"
    # Ejected while it was down (the 2 s before its restart; probes every 0.2 s), so its re-admission is one.
    assert ejection_s < RESTART_AT_S - KILL_AT_S
    assert status["replicas"][1]["ejections"] >= 1 and status["replicas"][1]["state"] == "healthy"
    assert tally.served_by_r1_after_readmission > 0
