"""GPU health in routing, end to end: three `dpserve sim` replicas behind the real router, their GPUs
faked at the NVML boundary. One GPU starts throttling under load: its replica is degraded by the first
GPU reading that sees the throttle, its share of new requests drops to about zero from then on, no
request fails, and it gets traffic again once the condition has been gone for the recovery time.
Windows of traffic are counted in requests, not seconds, so a slow machine only makes them longer."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pynvml
import pytest

from dpserve.config import RouterSettings
from dpserve.router.app import create_app
from tests.conftest import serving
from tests.fake_nvml import FakeGpu, FakeNvml
from tests.integration.conftest import running_sim

pytestmark = pytest.mark.integration

INTERVAL_S = 0.2
RECOVER_S = 1.0
WORKERS = 12
WINDOW = 60
"""Requests each window of traffic (before, throttled, after) holds at least."""


@dataclass
class Record:
    started: float
    replica: str
    ok: bool


@dataclass
class Traffic:
    url: str
    records: list[Record] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    async def worker(self, client: httpx.AsyncClient, number: int) -> None:
        body = {"model": "dpserve-tiny", "messages": [{"role": "user", "content": f"hi {number}"}], "max_tokens": 8}
        turn = 0
        while True:
            turn += 1
            stream = turn % 2 == 0
            started = time.monotonic()
            try:
                async with client.stream(
                    "POST", f"{self.url}/v1/chat/completions", json={**body, "stream": stream}
                ) as response:
                    text = (await response.aread()).decode()
                    ok = response.status_code == 200 and (not stream or text.rstrip().endswith("data: [DONE]"))
                    replica = response.headers.get("x-dpserve-replica", "?")
            except httpx.HTTPError as exc:
                ok, replica, text = False, "?", repr(exc)
            self.records.append(Record(started, replica, ok))
            if not ok:
                self.errors.append(text[:200])

    def share(self, replica: str, start: float, end: float) -> tuple[float, int]:
        picked = [r.replica for r in self.records if start <= r.started < end]
        return (Counter(picked)[replica] / len(picked) if picked else 0.0), len(picked)

    async def until(self, count: int, since: float, timeout_s: float = 60) -> float:
        """Waits until `count` requests started at or after `since` have finished; returns then."""
        deadline = time.monotonic() + timeout_s
        while sum(1 for r in self.records if r.started >= since) < count:
            assert time.monotonic() < deadline, f"fewer than {count} requests in {timeout_s} s"
            await asyncio.sleep(0.05)
        return time.monotonic()


class ThrottleReads(FakeNvml):
    """Logs each reading of GPU 1's throttle reasons: (wall-clock time, reasons)."""

    def __init__(self, gpus: list[FakeGpu]) -> None:
        super().__init__(gpus)
        self.reads: list[tuple[float, int]] = []

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        reasons = super().nvmlDeviceGetCurrentClocksEventReasons(handle)
        if handle == 1:
            self.reads.append((time.time(), reasons))
        return reasons


async def test_a_throttling_gpu_is_drained_of_new_requests_and_refilled_after_it_clears() -> None:
    nvml = ThrottleReads([FakeGpu(f"GPU-{i}", util_gpu=80) for i in range(3)])
    with contextlib.ExitStack() as stack:
        sims = [stack.enter_context(running_sim("--decode-ms-per-token", "4")) for _ in range(3)]
        settings = RouterSettings(
            replicas=tuple(f"r{i}={sim.url}@gpu={i}" for i, sim in enumerate(sims)),
            policy="least_loaded",
            probe_interval_s=INTERVAL_S,
            gpu_interval_s=INTERVAL_S,
            gpu_degrade_after_s=0.0,
            gpu_recover_after_s=RECOVER_S,
        )
        async with serving(create_app(settings, nvml=lambda: nvml)) as url, httpx.AsyncClient(timeout=30) as client:

            async def status() -> dict[str, dict]:  # type: ignore[type-arg]
                return {r["id"]: r for r in (await client.get(f"{url}/status")).json()["replicas"]}

            async def wait(predicate, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
                start = time.monotonic()
                while not predicate(await status()):
                    assert time.monotonic() - start < timeout_s, "timed out"
                    await asyncio.sleep(0.02)
                return time.monotonic()

            await wait(lambda s: len(s) == 3 and all(r["healthy"] and r["gpus"] for r in s.values()), 15)
            traffic = Traffic(url)
            workers = [asyncio.create_task(traffic.worker(client, n)) for n in range(WORKERS)]
            try:
                start = time.monotonic()
                await traffic.until(WINDOW, start)
                hot_at, hot_wall = time.monotonic(), time.time()
                nvml.gpus[1].throttle_reasons = pynvml.nvmlClocksEventReasonHwThermalSlowdown
                seen_at = await wait(lambda s: s["r1"]["state"] == "degraded", 15)
                full = (await client.get(f"{url}/status")).json()
                shown = {r["id"]: r for r in full["replicas"]}["r1"]
                # When the router marked it (its own clock, time.time): the test's polls of /status queue
                # behind the traffic on this one event loop, so when they see it says less.
                (gpu1,) = [gpu for gpu in full["gpus"]["devices"] if gpu["index"] == 1]
                degraded_wall = gpu1["health"]["since"]
                # On the records' clock; a request started after the mark reaches the router after it (the
                # 10 ms: reading the two clocks one after the other).
                drained_from = hot_at + (degraded_wall - hot_wall) + 0.01
                clear_at = await traffic.until(WINDOW, drained_from)
                nvml.gpus[1].throttle_reasons = 0
                back_at = await wait(lambda s: s["r1"]["state"] != "degraded", 15)
                end = await traffic.until(WINDOW, back_at + INTERVAL_S)
            finally:
                for task in workers:
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
            metrics = (await client.get(f"{url}/metrics")).text

    assert traffic.errors == [], traffic.errors[:3]
    # The readings that saw the throttle before the router marked the GPU: the first one alone.
    throttled_reads = [at for at, reasons in nvml.reads if reasons and at <= degraded_wall]
    before, n_before = traffic.share("r1", start, hot_at)
    drained, n_drained = traffic.share("r1", drained_from, clear_at)
    after, n_after = traffic.share("r1", back_at + INTERVAL_S, end)
    print(
        f"\nr1's share of new requests: {before:.0%} of {n_before} before; {drained:.1%} of {n_drained} from "
        f"its degradation; {after:.0%} of {n_after} after it cleared. Degraded "
        f"{degraded_wall - hot_wall:.2f} s after the throttle began, by reading {len(throttled_reads)} that saw it "
        f"(interval {INTERVAL_S} s; seen at /status after {seen_at - hot_at:.2f} s); back "
        f"{back_at - clear_at:.2f} s after it cleared (recover_after {RECOVER_S} s)"
    )
    assert before > 0.2 and n_before >= WINDOW and n_drained >= WINDOW and n_after >= WINDOW
    assert degraded_wall >= hot_wall
    assert len(throttled_reads) == 1
    assert drained <= 0.01
    assert back_at - clear_at >= RECOVER_S
    assert after > 0.15
    assert shown["degraded"] == ["GPU 1: throttled: hw_thermal"]
    assert 'dpserve_replica_gpu_degradations_total{replica="r1"} 1.0' in metrics
    assert 'dpserve_replica_degraded{replica="r1"} 0.0' in metrics
