"""How many requests a replica runs at once, learned from its own metrics, so the router can hold the
rest itself (in fair order) instead of piling them into the engine's first-come queue.

vLLM does not publish its batch limit (`--max-num-seqs`) or how many sequences its KV cache fits, but it
shows when it is full: requests wait (`vllm:num_requests_waiting` > 0). Once seen on two scrapes in a row
(one can catch a burst the scheduler has not yet taken in), the capacity is the most that ran on the last
few scrapes that showed requests waiting: the most, because a scrape can also land between a request
ending and the next one starting. After `PROBE_AFTER` scrapes in a row with the replica at its capacity
and nothing waiting, a sixteenth more (at least one) is tried, unless the KV cache is nearly full (more
requests would only be preempted): the first scrape that finds one waiting goes back. A replica that runs
more than its capacity with nothing waiting has that many at once.

It also learns whether the replica's slots idle between one request and the next: on scrapes where the
routers keep it full and nothing waits in it, the share of its slots not running is requests on their way
from the router to the engine (the answer's end reaching the router, the next request reaching the
engine). Where that is more than `SLOW_REFILL` of the slots (measured: a sixth of them on a CPU replica
answering in ~100 ms; well under 1% on the simulator), a request waiting in the engine fills them
(`flow/admission.py`'s engine queue). No I/O: the registry calls it on every scrape.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_NEARLY_FULL = 0.9
"""KV-cache usage above which the capacity does not rise."""
PROBE_AFTER = 5
"""Scrapes in a row at capacity with none waiting before one more request at once is tried."""
HISTORY = 4
"""Scrapes with requests waiting that the capacity is the most of (so it falls only when it stays lower)."""
IDLE_WEIGHT = 0.05
"""Weight of the newest scrape in the mean share of idle slots: small, since with 4 slots one scrape that
lands while a single request is in transit reads 25% (measured on the simulator: at 0.2 that alone pushed
a replica over `SLOW_REFILL` now and then)."""
SLOW_REFILL = 0.05
"""Mean share of a full replica's slots seen idle above which its slots refill too slowly from the router."""


@dataclass(frozen=True, slots=True)
class Capacity:
    limit: int = 0
    """Requests the replica runs at once (one more while that is being tried); 0: not known yet (it has
    never been seen full)."""
    waited_last: bool = False
    """The previous scrape saw requests waiting."""
    full_at: tuple[int, ...] = ()
    """How many ran at each of the last `HISTORY` scrapes that saw requests waiting (or that saw it run more
    than before with none waiting)."""
    full_for: int = 0
    """Scrapes in a row that found it at its capacity with none waiting."""
    idle: float = 0.0
    """Mean share of its slots not running on scrapes where the routers kept it full and none waited."""

    @property
    def slow_refill(self) -> bool:
        """Its slots idle noticeably between requests from the router: one waiting in the engine helps."""
        return self.idle > SLOW_REFILL

    @property
    def sighted(self) -> int:
        """Requests it runs at once as the scale signal reads it: the capacity, or before that is learned, the
        most it ran on a scrape that found requests waiting. One sighting sizes a fleet (a burst the engine
        has not taken in reads low: a replica more, not a request held), not the router's holding; on the
        elastic day's ramp, short waits never showed on two scrapes in a row and the signal could only add
        one replica after each wait (`docs/benchmarks/elastic.md`)."""
        return self.limit or max(self.full_at, default=0)

    @property
    def confirmed(self) -> int:
        """What it was last seen to run when full, not what is being tried; 0 while not known."""
        return min(self.limit, max(self.full_at)) if self.full_at and self.limit else self.limit


def learn(previous: Capacity, running: int, waiting: int, kv_usage: float, occupancy: int) -> Capacity:
    """The capacity after one scrape. `occupancy`: the routers' requests there at that moment."""
    idle = previous.idle
    if waiting > 0:
        full_at = (*previous.full_at, running)[-HISTORY:] if running > 0 else previous.full_at
        if previous.limit > previous.confirmed:
            return Capacity(previous.confirmed, True, full_at, idle=idle)  # the one more tried had to wait: back
        limit = max(full_at) if previous.waited_last and full_at else previous.limit
        return Capacity(limit, True, full_at, idle=idle)
    limit, full_at, full_for = previous.limit, previous.full_at, 0
    if limit and occupancy >= limit:
        # Full as far as the routers know, and nothing waits: the slots not running are requests in transit.
        idle += IDLE_WEIGHT * (max(0, limit - running) / limit - idle)
    if limit and kv_usage < KV_NEARLY_FULL:
        if running > previous.confirmed:
            full_at = (*full_at, running)[-HISTORY:]  # it runs that many at once
        if running >= limit and occupancy >= limit:
            full_for = previous.full_for + 1
            if full_for >= PROBE_AFTER:
                limit, full_for = running + max(1, running // 16), 0
        elif running > limit:
            limit = running
    return Capacity(limit, False, full_at, full_for, idle)
