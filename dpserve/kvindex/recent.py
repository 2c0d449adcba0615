"""Blocks the router has just sent to a replica, before that replica's KV events can say it cached them.

Between dispatching a request and the replica's BlockStored events (a prefill later), the KV index
cannot know the prompt's blocks are about to be cached there; a burst of requests sharing a new prefix
would otherwise be spread over every replica, each computing the prefix again. Entries expire after
`ttl_s` (by then the events have arrived, or the blocks were never cached), and the map is bounded.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from dpserve.kvindex.matching import deepest_holders

REFRESH_SHARE = 0.05
"""Of the TTL: how old a route of a block to a replica may be before routing it there again refreshes it."""


class RecentRoutes:
    def __init__(
        self, clock: Callable[[], float], ttl_s: float = 10.0, max_keys: int = 100_000, max_outbox: int = 0
    ) -> None:
        """`max_outbox` > 0: this router's own routes are also kept (that many at most) for its peers,
        who take them with `take_outbox` (with no peers nothing is kept)."""
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._log: deque[tuple[float, str, int]] = deque()
        self._pending: dict[str, int] = {}
        self._outbox: deque[tuple[str, Sequence[int]]] | None = deque(maxlen=max_outbox) if max_outbox > 0 else None
        self.on_news: Callable[[], None] | None = None
        """Called when the outbox gains a route (the peers' publisher wakes)."""
        self.peers = 0
        """Other routers whose live routes this map takes (peers and sibling workers heard lately; the peer
        board keeps it): their routes reach it a moment late, so kv_aware draws new prefixes among them."""

    def record(self, keys: Sequence[int], replica: str) -> None:
        """This router sent a prompt with these blocks to `replica`."""
        if self._outbox is not None:
            self._outbox.append((replica, keys))
            if self.on_news is not None:
                self.on_news()
        self.learn(keys, replica, 0.0, pending=True)

    def forget(self, replica: str, key: int) -> None:
        """The replica evicted this block (its own events say so): a route sent there before is no reason
        to think it still holds it."""
        holders = self._keys.get(key)
        if holders is not None and holders.pop(replica, None) is not None and not holders:
            del self._keys[key]

    def take_outbox(self) -> list[tuple[str, Sequence[int]]]:
        """This router's routes since the last call, oldest first (for its peers)."""
        if not self._outbox:
            return []
        routes = list(self._outbox)
        self._outbox.clear()
        return routes

    def learn(self, keys: Sequence[int], replica: str, age_s: float, pending: bool = False) -> None:
        """A route made `age_s` ago, by this router or a peer. `pending`: it counts towards `pending_blocks`
        (this router's own routes and, from the peer board, its peers' live ones, so peered routers weigh a
        replica's held blocks alike and agree where a new prefix goes; kv_aware's draw by the prefix's hash keeps
        them from all sending new prefixes that arrive together to one replica). A warm start's routes do not
        count."""
        now = self._clock() - age_s
        if pending:
            self._log.append((now, replica, len(keys)))
            self._pending[replica] = self._pending.get(replica, 0) + len(keys)
        # A block sent to the same replica within the last REFRESH_SHARE of the TTL is left as it is: a group's
        # shared prefix is routed many times a second, and its entries need not move each time (they expire at
        # most that share of the TTL early).
        recent_enough = now - self.ttl_s * REFRESH_SHARE
        entries = self._keys
        for key in keys:
            holders = entries.get(key)
            if holders is None:
                entries[key] = {replica: now}
                continue
            at = holders.get(replica)
            if at is not None and at >= recent_enough:
                continue
            if at is None or at <= now:
                holders[replica] = now
            entries.move_to_end(key)
        while len(entries) > self.max_keys:
            entries.popitem(last=False)

    def match(self, keys: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """Per replica, how many of `keys` (in prompt order) were sent there within the TTL, from the first
        on (`matching.leading_matches`, with the freshness test inlined: it runs for every block)."""
        oldest = self._clock() - self.ttl_s
        depth = dict.fromkeys(replicas, 0)
        active = list(depth)
        get = self._keys.get
        position = 0
        for position, key in enumerate(keys):
            holders = get(key)
            if not holders:
                break
            for rid in active:
                at = holders.get(rid)
                if at is None or at < oldest:
                    break
            else:
                continue  # every replica still in the race was sent this block too: no new list
            dropped = [rid for rid in active if not _sent_since(holders, rid, oldest)]
            for rid in dropped:
                depth[rid] = position
            active = [rid for rid in active if rid not in dropped]
            if not active:
                break
        else:
            position = len(keys)
        for rid in active:
            depth[rid] = position
        return depth

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

    def export(self) -> list[tuple[int, str, float]]:
        """Every (key, replica, age in seconds) within the TTL, oldest first: a starting peer's warm start."""
        oldest = self._clock() - self.ttl_s
        now = self._clock()
        return [
            (key, rid, now - at) for key, holders in self._keys.items() for rid, at in holders.items() if at >= oldest
        ]

    def __len__(self) -> int:
        return len(self._keys)


def _sent_since(holders: dict[str, float], replica: str, oldest: float) -> bool:
    at = holders.get(replica)
    return at is not None and at >= oldest
