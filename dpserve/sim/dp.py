"""Data parallelism as `vllm serve --data-parallel-size N` with its internal load balancing: N engines behind
one API server, each with its own batch, waiting queue and prefix cache.

Which engine a request goes to, as vLLM's front end decides it (v1/engine/core_client.py,
DPLBAsyncMPClient.get_core_engine_for_request):
- the `X-data-parallel-rank: R` header pins it to engine R; a header that is not an integer is ignored, and
  an integer outside [0, N) is refused (vLLM's input processor: "data_parallel_rank R is out of range [0, N).");
- otherwise the engine with the lowest score, scanning from a start index that moves on by one after every
  such choice (so ties go round-robin):
      score = max(in flight, waiting + running) + waiting x 6 x max(0, KV usage - 0.5)
  where "in flight" counts this server's requests sent to the engine and not yet finished. vLLM reads waiting,
  running and KV usage from the coordinator's snapshots (every 100 ms); the sim reads them live. No prefix
  awareness: the balancer does not look at the caches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from dpserve.sim.engine import GenerationRequest, RequestStats, SimEngine

RANK_HEADER = "X-data-parallel-rank"
WAITING_KV_PENALTY = 6.0
KV_PENALTY_FROM = 0.5


class RankOutOfRange(ValueError):
    pass


def header_rank(value: str | None) -> int | None:
    """The rank a request's header asks for, as vLLM reads it: None when absent or not an integer."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


class _Flight:
    """One request counted in flight on an engine until it finishes, or until whatever holds it is dropped
    (a streamed answer whose client left before it began never runs its generator's `finally`)."""

    __slots__ = ("_counts", "_rank")

    def __init__(self, counts: list[int], rank: int) -> None:
        self._counts: list[int] | None = counts
        self._rank = rank
        counts[rank] += 1

    def close(self) -> None:
        if self._counts is not None:
            self._counts[self._rank] -= 1
            self._counts = None

    def __del__(self) -> None:
        self.close()


class EngineGroup:
    """The engines, in rank order, and the choice of one per request."""

    def __init__(self, engines: Sequence[SimEngine]) -> None:
        if not engines:
            raise ValueError("at least one engine")
        self.engines = list(engines)
        self._in_flight = [0] * len(self.engines)
        self._start = 0

    @property
    def size(self) -> int:
        return len(self.engines)

    def in_flight(self, rank: int) -> int:
        return self._in_flight[rank]

    def check_rank(self, rank: int | None) -> None:
        if rank is not None and not 0 <= rank < self.size:
            raise RankOutOfRange(f"data_parallel_rank {rank} is out of range [0, {self.size}).")

    def score(self, rank: int) -> float:
        engine = self.engines[rank]
        waiting = engine.waiting
        score = float(max(self._in_flight[rank], waiting + engine.running))
        if waiting:
            score += waiting * WAITING_KV_PENALTY * max(0.0, engine.cache.usage - KV_PENALTY_FROM)
        return score

    def choose(self, rank: int | None) -> int:
        """The engine for a request pinned to `rank`, or, unpinned (None), the least loaded one."""
        self.check_rank(rank)
        if rank is not None:
            return rank
        best, best_score = self._start, float("inf")
        for offset in range(self.size):
            index = (self._start + offset) % self.size
            score = self.score(index)
            if score < best_score:
                best, best_score = index, score
        self._start = (self._start + 1) % self.size
        return best

    def generate(
        self, rank: int, request: GenerationRequest, output_ids: Sequence[int], stats: RequestStats, streamed: bool
    ) -> AsyncIterator[int]:
        """Engine `rank`'s `generate`, counted in flight on it from now until it finishes."""
        return _counted(_Flight(self._in_flight, rank), self.engines[rank], request, output_ids, stats, streamed)

    def reset_prefix_cache(self) -> bool:
        """Every engine resets what it can; the answer is engine 0's alone, as vLLM's front end returns only the
        first engine's result of a utility call sent to all (DPLBAsyncMPClient.call_utility_async)."""
        done = [engine.reset_prefix_cache() for engine in self.engines]
        return done[0]


async def _counted(
    flight: _Flight,
    engine: SimEngine,
    request: GenerationRequest,
    output_ids: Sequence[int],
    stats: RequestStats,
    streamed: bool,
) -> AsyncIterator[int]:
    try:
        async for token in engine.generate(request, output_ids, stats, streamed):
            yield token
    finally:
        flight.close()
