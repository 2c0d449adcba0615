"""How many requests a replica runs at once, learned from its own metrics, so the router can hold the
rest itself (in fair order) instead of piling them into the engine's first-come queue.

vLLM does not publish its batch limit (`--max-num-seqs`) or how many sequences its KV cache fits, but it
shows when it is full: requests wait (`vllm:num_requests_waiting` > 0). Seen on two scrapes in a row
(one can catch a burst the scheduler has not yet taken in), the number then running is the capacity.
While the router keeps a replica at its capacity and nothing waits there, the capacity is probed upward
by a sixteenth (at least one), unless the KV cache is nearly full: then more requests would only be
preempted. No I/O: the registry calls it on every scrape.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_NEARLY_FULL = 0.9
"""KV-cache usage above which the capacity is not probed upward."""


@dataclass(frozen=True, slots=True)
class Capacity:
    limit: int = 0
    """Requests the replica runs at once; 0: not known yet (it has never been seen full)."""
    waited_last: bool = False
    """The previous scrape saw requests waiting."""


def learn(previous: Capacity, running: int, waiting: int, kv_usage: float, occupancy: int) -> Capacity:
    """The capacity after one scrape. `occupancy`: the requests the routers had there at that moment."""
    if waiting > 0:
        if previous.waited_last and running > 0:
            return Capacity(running, True)
        return Capacity(previous.limit, True)
    limit = previous.limit
    if limit and occupancy >= limit and running >= limit and kv_usage < KV_NEARLY_FULL:
        limit += max(1, limit // 16)
    return Capacity(limit, False)
