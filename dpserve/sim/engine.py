"""The simulated engine: a batch of at most `max_num_seqs` running requests, a waiting queue (first come,
first served; or by each request's `priority`, then arrival, as vLLM's `--scheduling-policy priority`), the
prefix cache, and a latency model. No model runs: time passes by `asyncio.sleep` alone, so a sim costs
almost no CPU and many of them share two cores.

Latency, for a request admitted while `b` requests run (itself included):
  time to first token = uncached prompt tokens x prefill_s_per_token x slowdown(b)
  each later token    = decode_s_per_token x slowdown(b)
  slowdown(b)         = 1 + batch_slowdown x (b - 1), then x (1 +- jitter), all / speed (speed 0: no waits)
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from dpserve.config import SCHEDULING_POLICIES
from dpserve.kvindex.events import KvEvent
from dpserve.sim.cache import Allocation, NoRoom, PrefixCache, TooLarge

# A non-streamed request sleeps once per this many tokens rather than once per token: fewer timers.
BUFFERED_TOKENS_PER_WAKE = 16


@dataclass(frozen=True, slots=True)
class LatencyModel:
    prefill_s_per_token: float = 0.0001
    decode_s_per_token: float = 0.01
    batch_slowdown: float = 0.02
    jitter: float = 0.0
    speed: float = 1.0

    def factor(self, batch: int, rng: random.Random) -> float:
        if self.speed <= 0:
            return 0.0
        slowdown = 1.0 + self.batch_slowdown * max(0, batch - 1)
        if self.jitter:
            slowdown *= max(0.0, 1.0 + rng.uniform(-self.jitter, self.jitter))
        return slowdown / self.speed


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt_ids: Sequence[int]
    max_tokens: int
    finish_reason: str
    """"length" when the client set max_tokens; "stop" when the simulated model chose its own length."""
    priority: int = 0
    """vLLM's request field: lower waits less, under the priority scheduling policy (ignored otherwise)."""


@dataclass(slots=True)
class RequestStats:
    arrived: float
    admitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    cached_tokens: int = 0
    output_tokens: int = 0


class RequestTooLarge(ValueError):
    pass


class EngineObserver:
    """What the engine reports as requests move (the metrics); the default does nothing."""

    def on_admitted(self, request: GenerationRequest, stats: RequestStats) -> None: ...

    def on_token(self, stats: RequestStats, gap_s: float | None) -> None: ...

    def on_finished(self, request: GenerationRequest, stats: RequestStats, reason: str) -> None: ...


class SimEngine:
    def __init__(
        self,
        cache: PrefixCache,
        latency: LatencyModel,
        max_num_seqs: int,
        seed: int = 0,
        observer: EngineObserver | None = None,
        publish: Callable[[list[KvEvent]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        scheduling_policy: str = "fcfs",
    ) -> None:
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy {scheduling_policy!r}: one of {', '.join(SCHEDULING_POLICIES)}")
        self.cache = cache
        self.latency = latency
        self.max_num_seqs = max_num_seqs
        self.running = 0
        self._by_priority = scheduling_policy == "priority"
        # A heap of (priority, arrival number, request, future): arrival order alone under fcfs (priority 0).
        self._waiting: list[tuple[int, int, GenerationRequest, asyncio.Future[Allocation]]] = []
        self._arrivals = itertools.count()
        self._rng = random.Random(seed)
        self._observer = observer or EngineObserver()
        self._publish_events = publish
        self._clock = clock

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def choose_output(self, choices: Sequence[int], count: int) -> list[int]:
        return [self._rng.choice(choices) for _ in range(count)]

    def free_length(self, limit: int) -> int:
        """How many tokens a simulated model writes before it stops by itself."""
        return self._rng.randint(1, max(1, min(64, limit)))

    async def generate(
        self, request: GenerationRequest, output_ids: Sequence[int], stats: RequestStats, streamed: bool
    ) -> AsyncIterator[int]:
        """The request's output token ids, paced by the latency model, with `stats` filled in as it goes;
        closing the iterator early frees its blocks. Call `check_fits` first: a request too large for
        the cache would wait forever."""
        allocation = await self._admit(request)
        reason = "abort"
        try:
            stats.admitted = self._clock()
            stats.cached_tokens = allocation.hit_tokens
            self._observer.on_admitted(request, stats)
            uncached = len(request.prompt_ids) - allocation.hit_tokens
            await self._wait(uncached * self.latency.prefill_s_per_token)
            last = self._clock()
            stats.first_token = last
            per_wake = 1 if streamed else BUFFERED_TOKENS_PER_WAKE
            final = len(output_ids) - 1
            for index, token in enumerate(output_ids):
                if index:
                    if index % per_wake == 0:
                        await self._wait(self.latency.decode_s_per_token * per_wake)
                    elif index == final:  # the tokens since the last wake: every later token takes its time
                        await self._wait(self.latency.decode_s_per_token * (index % per_wake))
                    now = self._clock()
                    self._observer.on_token(stats, now - last)
                    last = now
                else:
                    self._observer.on_token(stats, None)
                stats.output_tokens += 1
                yield token
            reason = request.finish_reason
        finally:
            stats.finished = self._clock()
            self.cache.free(allocation)
            self.running -= 1
            self._observer.on_finished(request, stats, reason)
            self._admit_waiting()

    async def _wait(self, base_s: float) -> None:
        delay = base_s * self.latency.factor(self.running, self._rng)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _admit(self, request: GenerationRequest) -> Allocation:
        if not self._waiting and self.running < self.max_num_seqs:
            allocation = self._try_allocate(request)
            if allocation is not None:
                return allocation
        future: asyncio.Future[Allocation] = asyncio.get_running_loop().create_future()
        priority = request.priority if self._by_priority else 0
        heapq.heappush(self._waiting, (priority, next(self._arrivals), request, future))
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                # Admitted in the same instant the caller gave up: hand the blocks back.
                self.cache.free(future.result())
                self.running -= 1
                self._admit_waiting()
            else:
                self._remove_waiter(future)
            raise

    def check_fits(self, request: GenerationRequest) -> None:
        """Raise RequestTooLarge when the request could never fit the cache, even empty."""
        try:
            self.cache.check_fits(len(request.prompt_ids) + request.max_tokens)
        except TooLarge as exc:
            raise RequestTooLarge(str(exc)) from None

    def _try_allocate(self, request: GenerationRequest) -> Allocation | None:
        try:
            allocation = self.cache.allocate(request.prompt_ids, request.max_tokens)
        except NoRoom:
            return None
        self.running += 1
        self._publish()
        return allocation

    def _admit_waiting(self) -> None:
        """In queue order: the head waits for room rather than letting smaller ones pass."""
        waiting = self._waiting
        while waiting and self.running < self.max_num_seqs:
            _, _, request, future = waiting[0]
            if future.done():
                heapq.heappop(waiting)
                continue
            allocation = self._try_allocate(request)
            if allocation is None:
                return
            heapq.heappop(waiting)
            future.set_result(allocation)

    def _remove_waiter(self, future: asyncio.Future[Allocation]) -> None:
        for index, entry in enumerate(self._waiting):
            if entry[3] is future:
                del self._waiting[index]
                heapq.heapify(self._waiting)
                return

    def _publish(self) -> None:
        events = self.cache.take_events()
        if events and self._publish_events is not None:
            self._publish_events(events)

    def reset_prefix_cache(self) -> bool:
        done = self.cache.reset()
        self._publish()
        return done
