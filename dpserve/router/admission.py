"""Admission control: at most `limit` requests in flight per replica; past that, a bounded FIFO queue
with a timeout. A full queue or a wait past the timeout is refused with 429 and `Retry-After`, so a
burst cannot pile unbounded work on the GPUs or unbounded memory on the router."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence

from dpserve.policies.base import ReplicaView
from dpserve.router.errors import OpenAIError


class Rejected(OpenAIError):
    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(
            429,
            message,
            type="rate_limit_error",
            code=reason,
            headers={"retry-after": str(max(1, math.ceil(retry_after_s)))},
        )
        self.reason = reason


class Admission:
    def __init__(
        self,
        limit_per_replica: int,
        queue_size: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`limit_per_replica` 0: no limit (and no queue)."""
        self.limit = limit_per_replica
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self._clock = clock
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def depth(self) -> int:
        return len(self._waiters)

    def open(self, candidates: Sequence[ReplicaView]) -> list[ReplicaView]:
        """The candidates with room for one more request."""
        if self.limit <= 0:
            return list(candidates)
        return [c for c in candidates if c.in_flight < self.limit]

    async def wait_for_room(self, has_room: Callable[[], bool]) -> float:
        """Returns once `has_room()` holds and no earlier request is still waiting; the seconds waited.
        Raises `Rejected` when the queue is full or the wait outlasts the timeout."""
        if not self._waiters and has_room():
            return 0.0
        if len(self._waiters) >= self.queue_size:
            raise Rejected(
                "queue_full",
                "The router is at capacity and its queue is full; retry after a moment.",
                self.timeout_s / 4,
            )
        started = self._clock()
        deadline = started + self.timeout_s
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            while True:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise Rejected(
                        "queue_timeout",
                        f"No replica had room for this request within {self.timeout_s:g} s; retry later.",
                        self.timeout_s / 4,
                    )
                # Only the head of the queue may take a slot, so requests are admitted in arrival order.
                if self._waiters[0] is waiter and has_room():
                    return self._clock() - started
                try:
                    await asyncio.wait_for(asyncio.shield(waiter), remaining)
                except TimeoutError:
                    continue
                waiter = self._rearm(waiter)
        finally:
            self._waiters.remove(waiter)
            # The next in line may find room too (several slots freed at once, or this one gave up).
            self.notify()

    def notify(self) -> None:
        """A slot may have freed: wake the head of the queue to look."""
        if self._waiters and not self._waiters[0].done():
            self._waiters[0].set_result(None)

    def _rearm(self, waiter: asyncio.Future[None]) -> asyncio.Future[None]:
        """A fresh future in the same queue position, for the next wake-up."""
        fresh: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[self._waiters.index(waiter)] = fresh
        return fresh
