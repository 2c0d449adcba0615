"""The simulated engine: a batch of at most `max_num_seqs` running requests, a FIFO waiting queue, the
prefix cache, and a latency model. No model runs: time passes by `asyncio.sleep` alone, so a sim costs
almost no CPU and many of them share two cores.

Latency, for a request admitted while `b` requests run (itself included):
  time to first token = uncached prompt tokens x prefill_s_per_token x slowdown(b)
  each later token    = decode_s_per_token x slowdown(b)
  slowdown(b)         = 1 + batch_slowdown x (b - 1), then x (1 +- jitter), all / speed (speed 0: no waits)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

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
    ) -> None:
        self.cache = cache
        self.latency = latency
        self.max_num_seqs = max_num_seqs
        self.running = 0
        self._waiting: deque[tuple[GenerationRequest, asyncio.Future[Allocation]]] = deque()
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
        self._waiting.append((request, future))
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
        """First come, first served: the head waits for room rather than letting smaller ones pass."""
        while self._waiting and self.running < self.max_num_seqs:
            request, future = self._waiting[0]
            if future.done():
                self._waiting.popleft()
                continue
            allocation = self._try_allocate(request)
            if allocation is None:
                return
            self._waiting.popleft()
            future.set_result(allocation)

    def _remove_waiter(self, future: asyncio.Future[Allocation]) -> None:
        for index, (_, waiter) in enumerate(self._waiting):
            if waiter is future:
                del self._waiting[index]
                return

    def _publish(self) -> None:
        events = self.cache.take_events()
        if events and self._publish_events is not None:
            self._publish_events(events)

    def reset_prefix_cache(self) -> bool:
        done = self.cache.reset()
        self._publish()
        return done
