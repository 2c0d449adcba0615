"""Blocks the router has just sent to a replica, before that replica's KV events can say it cached them.

Between dispatching a request and the replica's BlockStored events (a prefill later), the KV index
cannot know the prompt's blocks are about to be cached there; a burst of requests sharing a new prefix
would otherwise be spread over every replica, each computing the prefix again. Entries expire after
`ttl_s` (by then the events have arrived, or the blocks were never cached), and the map is bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from dpserve.kvindex.matching import leading_matches


class RecentRoutes:
    def __init__(self, clock: Callable[[], float], ttl_s: float = 10.0, max_keys: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[int, dict[str, float]] = OrderedDict()

    def record(self, keys: Sequence[int], replica: str) -> None:
        now = self._clock()
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

    def __len__(self) -> int:
        return len(self._keys)
