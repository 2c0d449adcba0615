"""How many requests a replica runs at once, learned from its own metrics, so the router can hold the
rest itself (in fair order) instead of piling them into the engine's first-come queue.

vLLM does not publish its batch limit (`--max-num-seqs`) or how many sequences its KV cache fits, but it
shows when it is full: requests wait (`vllm:num_requests_waiting` > 0). Once seen on two scrapes in a row
(one can catch a burst the scheduler has not yet taken in), the capacity is the most that ran on the last
few scrapes that showed requests waiting: the most, because a scrape can also land between a request
ending and the next one starting. While the router keeps a replica at its capacity and nothing waits
there, the capacity is probed upward by a sixteenth (at least one), unless the KV cache is nearly full:
then more requests would only be preempted. No I/O: the registry calls it on every scrape.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_NEARLY_FULL = 0.9
"""KV-cache usage above which the capacity is not probed upward."""
HISTORY = 4
"""Scrapes with requests waiting that the capacity is the most of (so it falls only when it stays lower)."""


@dataclass(frozen=True, slots=True)
class Capacity:
    limit: int = 0
    """Requests the replica runs at once; 0: not known yet (it has never been seen full)."""
    waited_last: bool = False
    """The previous scrape saw requests waiting."""
    full_at: tuple[int, ...] = ()
    """How many ran at each of the last `HISTORY` scrapes that saw requests waiting."""


def learn(previous: Capacity, running: int, waiting: int, kv_usage: float, occupancy: int) -> Capacity:
    """The capacity after one scrape. `occupancy`: the requests the routers had there at that moment."""
    if waiting > 0:
        full_at = (*previous.full_at, running)[-HISTORY:] if running > 0 else previous.full_at
        limit = max(full_at) if previous.waited_last and full_at else previous.limit
        return Capacity(limit, True, full_at)
    limit = previous.limit
    if limit and occupancy >= limit and running >= limit and kv_usage < KV_NEARLY_FULL:
        limit += max(1, limit // 16)
    return Capacity(limit, False, previous.full_at)
