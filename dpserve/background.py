"""Background work (probes, KV-event subscribers, GPU sampling, discovery, peers): the end of a task, each
started with its app and stopped with it; and the CPU each part spends (`CpuMeter`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Generator, Iterator
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Cancels `task` (none: nothing to do) and returns once it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class CpuMeter:
    """CPU seconds (user + system, of the event loop's thread) spent in one part's work: `meter.run(work)` for
    a coroutine, each of its steps timed (its waits are not CPU); `with meter.measuring():` around a
    callback. Exclusive: work metered inside other metered work (a scrape inside a probe) counts for its own
    meter only. A task the work starts (`asyncio.gather` of coroutines starts one each) runs apart: meter its
    coroutine too. For the event loop's thread alone (the nesting is tracked there)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def run(self, work: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        return _metered(work, self)

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        started = _enter(self)
        try:
            yield
        finally:
            _leave(self, started)


_running: list[CpuMeter] = []
"""The meters whose work runs now, innermost last."""


def _enter(meter: CpuMeter) -> float:
    _running.append(meter)
    return time.thread_time()


def _leave(meter: CpuMeter, started: float) -> None:
    spent = time.thread_time() - started
    meter.seconds += spent
    _running.pop()
    if _running:
        _running[-1].seconds -= spent  # the outer work's step included it


async def _metered(work: Coroutine[Any, Any, T], meter: CpuMeter) -> T:
    return await _Steps(work, meter)


class _Steps(Generic[T]):
    """Drives `work` as a task drives a coroutine, timing each step."""

    def __init__(self, work: Coroutine[Any, Any, T], meter: CpuMeter) -> None:
        self._work = work
        self._meter = meter

    def __await__(self) -> Generator[Any, Any, T]:
        work, meter = self._work, self._meter
        value: Any = None
        error: BaseException | None = None
        while True:
            started = _enter(meter)
            try:
                signal = work.send(value) if error is None else work.throw(error)
            except StopIteration as done:
                return cast(T, done.value)
            finally:
                _leave(meter, started)
            value, error = None, None
            try:
                value = yield signal
            except GeneratorExit:
                work.close()
                raise
            except BaseException as exc:  # a cancellation: into the work, as a task throws it into its coroutine
                error = exc
