"""`CpuMeter`: a part's CPU, not its waits; nested parts counted once, each for its own; a metered task
behaves as the task would unmetered (its result, its errors, its cancellation)."""

from __future__ import annotations

import asyncio
import time

import pytest

from dpserve.background import CpuMeter


def burn(seconds: float) -> None:
    """`seconds` of this thread's CPU."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


async def test_a_metered_coroutine_counts_its_steps_cpu_not_its_waits() -> None:
    meter = CpuMeter()

    async def work() -> str:
        burn(0.03)
        await asyncio.sleep(0.1)
        burn(0.03)
        return "done"

    started = time.monotonic()
    assert await meter.run(work()) == "done"
    assert time.monotonic() - started >= 0.1
    assert 0.055 <= meter.seconds < 0.09, meter.seconds


async def test_nested_meters_count_each_part_once() -> None:
    outer, inner, callback = CpuMeter(), CpuMeter(), CpuMeter()

    async def scrape() -> None:
        burn(0.03)
        await asyncio.sleep(0)
        with callback.measuring():
            burn(0.02)

    async def probe() -> None:
        burn(0.03)
        await inner.run(scrape())

    await outer.run(probe())
    assert 0.028 <= outer.seconds < 0.045, outer.seconds
    assert 0.028 <= inner.seconds < 0.045, inner.seconds
    assert 0.018 <= callback.seconds < 0.035, callback.seconds


async def test_a_metered_task_fails_and_is_cancelled_as_its_coroutine_would_be() -> None:
    meter = CpuMeter()

    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad answer")

    with pytest.raises(ValueError, match="bad answer"):
        await meter.run(fails())
    cleaned = asyncio.Event()

    async def waits() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.set()

    task = asyncio.create_task(meter.run(waits()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set() and task.cancelled()
