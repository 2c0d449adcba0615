"""Blocks the router has just sent to a replica, before that replica's KV events can say it cached them.

Between dispatching a request and the replica's BlockStored events (a prefill later), the KV index
cannot know the prompt's blocks are about to be cached there; a burst of requests sharing a new prefix
would otherwise be spread over every replica, each computing the prefix again. Entries expire after
`ttl_s` (by then the events have arrived, or the blocks were never cached), and the map is bounded.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from dpserve.kvindex.matching import deepest_holders, leading_matches


class RecentRoutes:
    def __init__(self, clock: Callable[[], float], ttl_s: float = 10.0, max_keys: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._log: deque[tuple[float, str, int]] = deque()
        self._pending: dict[str, int] = {}

    def record(self, keys: Sequence[int], replica: str) -> None:
        now = self._clock()
        self._log.append((now, replica, len(keys)))
        self._pending[replica] = self._pending.get(replica, 0) + len(keys)
        for key in keys:
            holders = self._keys.get(key)
            if holders is None:
                self._keys[key] = {replica: now}
            else:
                holders[replica] = now
                self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def match(self, keys: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        oldest = self._clock() - self.ttl_s

        def fresh_holders(key: int) -> set[str] | None:
            holders = self._keys.get(key)
            return {rid for rid, at in holders.items() if at >= oldest} if holders else None

        return leading_matches(keys, replicas, fresh_holders)

    def likely_best(self, keys: Sequence[int], limit: int) -> list[str]:
        """Up to `limit` replicas the prompt's blocks were recently sent to (see `deepest_holders`)."""
        return deepest_holders(keys, self._keys.get, limit)

    def pending_blocks(self, replica: str) -> int:
        """Blocks routed to `replica` within the TTL (counted per request, repeats included)."""
        oldest = self._clock() - self.ttl_s
        while self._log and self._log[0][0] < oldest:
            _, rid, count = self._log.popleft()
            self._pending[rid] -= count
        return self._pending.get(replica, 0)

    def __len__(self) -> int:
        return len(self._keys)
