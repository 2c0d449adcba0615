"""What this router knows from its peers, and what it tells them. No I/O: `peers/links.py` carries the updates.

Each peer (an `origin`: one life of one router process) sends whole in-flight counts and health verdicts
in every update, so the newest update replaces the last and a lost one costs nothing; routes and session
bindings come as news and go straight into the recent-route map and the binding table. A peer is
forgotten (its counts stop counting) when it says goodbye, when the link that brought it drops, or when
it has been silent for `timeout_s`. A fall in what peers have in flight on a replica is believed after a random
pause of up to `fall_spread_s`: every router hears of the same freed slots at once, and each taking them
together ran a replica capped at 2 (`--max-in-flight`) at 4-5 behind 3 routers; the first to take it tells
the others at once (`contested`), before their pauses end. Updates older than the last one seen from the same
origin, or sent more than `stale_s` ago by the sender's clock, are dropped. Replica URLs this router does not
know are skipped: each router keeps its own fleet, found by its own flags or DNS.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dpserve.kvindex.index import KvIndex
from dpserve.kvindex.recent import RecentRoutes
from dpserve.policies.bindings import SessionBindings
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.flow.quotas import QuotaBook
from dpserve.router.peers.wire import MAX_MODELS, MAX_ROUTES, MAX_USAGE, PeerSnapshot, PeerUpdate
from dpserve.router.scale.held import Held

FALL_SPREAD_S = 0.1
"""A router's pause before it believes a fall in peers' counts, at most: long beside the few milliseconds in which
the first router to take a freed slot tells the others (at once, while contested), short beside an answer."""


class HeldShare(Protocol):
    """Where requests held in the routers are counted per model: the scale signal's queue (`scale/advisor.py`)."""

    def own_held(self) -> dict[str, Held]:
        """Model -> the requests this router holds for it (on the board's clock)."""
        ...

    def peer_held(self, origin: str, held: dict[str, Held]) -> None:
        """What one peer holds now, in the same form (empty: nothing, or the peer is gone)."""
        ...


@dataclass
class PeerOrigin:
    id: str
    seq: int
    heard_at: float
    link: str
    """The link whose update was the newest (a sibling worker's updates may also come relayed)."""
    in_flight: dict[str, int]
    """Local replica id -> its requests in flight there."""
    unhealthy: frozenset[str]


@dataclass
class BoardStats:
    updates: int = 0
    stale: int = 0
    """Updates dropped: not newer than one already seen from that origin, or older than `stale_s`."""
    unknown_replicas: int = 0
    """Replica URLs in updates that this router does not route to."""
    routes: int = 0
    bindings: int = 0
    forgotten: dict[str, int] = field(default_factory=dict)
    """Origins forgotten, by why: left, silent, link_lost, crowded (more origins than `max_origins`)."""


class PeerBoard:
    def __init__(
        self,
        registry: ReplicaRegistry,
        origin: str,
        recent: RecentRoutes | None = None,
        bindings: SessionBindings | None = None,
        kv_index: KvIndex | None = None,
        *,
        timeout_s: float = 2.0,
        stale_s: float = 5.0,
        max_origins: int = 256,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        quotas: QuotaBook | None = None,
        fall_spread_s: float = 0.0,
        rng: random.Random | None = None,
        held: HeldShare | None = None,
    ) -> None:
        """`quotas`: where peers' usage counts (quotas hold across routers) and this router's own is taken from.
        `fall_spread_s`: falls in peers' counts are believed after a random pause up to this (0: at once).
        `held`: where peers' held requests count and this router's own are taken from."""
        self.origin = origin
        self.timeout_s = timeout_s
        self.stale_s = stale_s
        self.max_origins = max_origins
        self.stats = BoardStats()
        self._registry = registry
        self._recent = recent
        self._bindings = bindings
        self._kv_index = kv_index
        self._clock = clock
        self._wall = wall
        self._origins: dict[str, PeerOrigin] = {}
        self._seq = 0
        self._shape: tuple[int, dict[str, str], tuple[str, ...]] = (-1, {}, ())
        """(the registry's reshape count, replica ids by where, the unhealthy): rebuilt when it reshapes."""
        self.quotas = quotas
        self.held = held
        self.fall_spread_s = fall_spread_s
        self._rng = rng or random.Random()
        self._believed: dict[str, int] = {}
        """Replica id -> what the registry was told peers have in flight there (absent: none)."""
        self._falls: dict[str, float] = {}
        """Replica id -> when the fall in peers' count there is believed (the older, higher count until then)."""
        self._contested_until = -1.0

    # -- what peers say ------------------------------------------------------------------------------

    def apply(self, update: PeerUpdate, link: str) -> list[str]:
        """Takes one peer update in; returns the replicas (ids) a peer has newly found unhealthy while this
        router still routes to them, for this router to check for itself."""
        if update.origin == self.origin:
            return []  # our own, relayed back
        known = self._origins.get(update.origin)
        if (known is not None and update.seq <= known.seq) or self._wall() - update.sent_at > self.stale_s:
            self.stats.stale += 1
            return []
        if update.leaving:
            self._forget(update.origin, "left")
            return []
        self.stats.updates += 1
        ids = self._ids_by_url()
        in_flight: dict[str, int] = {}
        for url, count in update.in_flight.items():
            rid = ids.get(url)
            if rid is None:
                self.stats.unknown_replicas += 1
            elif count:
                in_flight[rid] = count
        unhealthy = frozenset(rid for url in update.unhealthy if (rid := ids.get(url)) is not None)
        if self._recent is not None:
            for url, keys in update.routes:
                rid = ids.get(url)
                if rid is not None:
                    self._recent.learn(keys, rid, 0.0, pending=True)  # held alike in every router
                    self.stats.routes += 1
        if self._bindings is not None:
            for session, url in update.bindings:
                rid = ids.get(url)
                if rid is not None:
                    self._bindings.learn(session, rid)
                    self.stats.bindings += 1
        if self.quotas is not None:
            for tenant, requests, tokens in update.usage:
                self.quotas.add_remote(update.origin, tenant, requests, tokens)
        if self.held is not None:
            # Their wall clock to this board's: a wait is read here as it grows.
            offset = self._clock() - self._wall()
            self.held.peer_held(update.origin, {model: held.moved(offset) for model, held in update.held})
        before = known.unhealthy if known is not None else frozenset()
        if known is None and len(self._origins) >= self.max_origins:
            oldest = min(self._origins.values(), key=lambda o: o.heard_at)
            self._forget(oldest.id, "crowded")
        self._origins[update.origin] = PeerOrigin(update.origin, update.seq, self._clock(), link, in_flight, unhealthy)
        self._recount()
        return [rid for rid in unhealthy - before if (r := self._registry.find(rid)) is not None and r.routable]

    def expire(self) -> None:
        """Forgets peers silent for longer than `timeout_s` (killed, hung or cut off)."""
        oldest = self._clock() - self.timeout_s
        for origin in [o.id for o in self._origins.values() if o.heard_at < oldest]:
            self._forget(origin, "silent")

    def link_lost(self, link: str) -> None:
        """A link closed: the peers it brought are gone, or will come back through another link."""
        for origin in [o.id for o in self._origins.values() if o.link == link]:
            self._forget(origin, "link_lost")

    def _forget(self, origin: str, why: str) -> None:
        if self._origins.pop(origin, None) is not None:
            self.stats.forgotten[why] = self.stats.forgotten.get(why, 0) + 1
            self._recount()
            if self.held is not None:
                self.held.peer_held(origin, {})

    def _recount(self) -> None:
        totals: dict[str, int] = {}
        for origin in self._origins.values():
            for rid, count in origin.in_flight.items():
                totals[rid] = totals.get(rid, 0) + count
        if self.fall_spread_s:
            self._hold_falls(totals)
        self._believed = {rid: count for rid, count in totals.items() if count}
        self._registry.set_peer_in_flight(self._believed)
        if self._recent is not None:
            self._recent.peers = len(self._origins)  # the routers placing new prefixes beside this one

    def _hold_falls(self, totals: dict[str, int]) -> None:
        """Keeps the counts that fell at their older value until each fall's pause ends (a rise ends it)."""
        now = self._clock()
        falls = {}
        for rid, held in self._believed.items():
            if totals.get(rid, 0) >= held:
                continue
            due = self._falls.get(rid)
            if due is None:
                due = now + self._rng.uniform(0.0, self.fall_spread_s)
                # Peers heard of this fall too: until their pauses end, this router's takes are news to them.
                self._contested_until = max(self._contested_until, now + 2 * self.fall_spread_s)
            if now < due:
                falls[rid] = due
                totals[rid] = held
        self._falls = falls

    def now(self) -> float:
        return self._clock()

    def next_fall_at(self) -> float | None:
        """When the next held fall is due (by this board's clock); None when none is held."""
        return min(self._falls.values(), default=None)

    def believe_falls(self) -> None:
        """Lets the falls whose pause has ended count (the registry then tells waiters of the room)."""
        if self._falls:
            self._recount()

    def contested(self) -> bool:
        """Whether peers may be about to take slots freed with this router's: its own takes should reach
        them at once rather than with the next batched update."""
        return self._clock() < self._contested_until

    def _ids_by_url(self) -> dict[str, str]:
        return self._fleet_shape()[1]

    def _fleet_shape(self) -> tuple[int, dict[str, str], tuple[str, ...]]:
        """Ids by where and the unhealthy, scanned once per change of the fleet's shape, not per update: at
        a thousand replicas a scan per update was most of an idle router's peer cost."""
        registry = self._registry
        if self._shape[0] != registry.reshapes:
            replicas = list(registry)
            ids = {replica.where: replica.id for replica in replicas}
            unhealthy = tuple(r.where for r in replicas if r.health.ever_healthy and not r.healthy)
            self._shape = (registry.reshapes, ids, unhealthy)
        return self._shape

    # -- what this router says -----------------------------------------------------------------------

    def update(self, leaving: bool = False, news: bool = True) -> PeerUpdate:
        """This router's update for its peers now: whole counts and verdicts, and (`news`) the routes and
        bindings made since the last update (taken: the next update does not repeat them)."""
        self._seq += 1
        registry = self._registry
        routes = []
        if self._recent is not None and news:
            for rid, keys in self._recent.take_outbox()[-MAX_ROUTES:]:
                replica = registry.find(rid)
                if replica is not None and keys:
                    routes.append((replica.where, keys))
        bindings = []
        if self._bindings is not None and news:
            for session, rid in self._bindings.take_outbox()[-MAX_ROUTES:]:
                replica = registry.find(rid)
                if replica is not None:
                    bindings.append((session, replica.where))
        usage = []
        if self.quotas is not None and news:
            usage = [(tenant, requests, tokens) for tenant, (requests, tokens) in self.quotas.take_news().items()]
        held: tuple[tuple[str, Held], ...] = ()
        if self.held is not None:
            # To the wall clock, rounded: the same queue is the same update (`links.py` sends on a change).
            offset = self._wall() - self._clock()
            held = tuple((model, counts.moved(offset)) for model, counts in self.held.own_held().items())[:MAX_MODELS]
        return PeerUpdate(
            origin=self.origin,
            seq=self._seq,
            sent_at=self._wall(),
            in_flight={r.where: r.in_flight for r in registry.busy() if r.in_flight},
            unhealthy=self._fleet_shape()[2],
            routes=routes,
            bindings=bindings,
            usage=usage[:MAX_USAGE],
            held=held,
            leaving=leaving,
        )

    # -- warm start ----------------------------------------------------------------------------------

    def snapshot(self) -> PeerSnapshot:
        """This router's KV index and recent routes, for a peer that is starting."""
        kv = []
        recent = []
        for replica in self._registry:
            if self._kv_index is not None:
                size, entries = self._kv_index.export(replica.id)
                if entries:
                    kv.append((replica.where, size, entries))
        if self._recent is not None:
            urls = {replica.id: replica.where for replica in self._registry}
            recent = [(key, urls[rid], age) for key, rid, age in self._recent.export() if rid in urls]
        return PeerSnapshot(self.origin, kv, recent)

    def load(self, snapshot: PeerSnapshot) -> tuple[int, int]:
        """Takes a peer's snapshot in; (KV blocks, recent routes) loaded."""
        ids = self._ids_by_url()
        blocks = routes = 0
        if self._kv_index is not None:
            for url, size, entries in snapshot.kv:
                rid = ids.get(url)
                if rid is not None:
                    blocks += self._kv_index.load(rid, size, entries)
        if self._recent is not None:
            for key, url, age in snapshot.recent:
                rid = ids.get(url)
                if rid is not None:
                    self._recent.learn((key,), rid, age)
                    routes += 1
        return blocks, routes

    # -- what /status shows --------------------------------------------------------------------------

    @property
    def origins(self) -> list[PeerOrigin]:
        return list(self._origins.values())

    def status(self) -> dict[str, Any]:
        now = self._clock()
        return {
            "origin": self.origin,
            "peers": [
                {
                    "origin": o.id,
                    "link": o.link,
                    "seconds_since_heard": round(now - o.heard_at, 3),
                    "in_flight": sum(o.in_flight.values()),
                    "unhealthy": sorted(o.unhealthy),
                }
                for o in self._origins.values()
            ],
            "updates": self.stats.updates,
            "stale": self.stats.stale,
            "unknown_replicas": self.stats.unknown_replicas,
            "routes_learned": self.stats.routes,
            "bindings_learned": self.stats.bindings,
            "forgotten": dict(self.stats.forgotten),
        }
