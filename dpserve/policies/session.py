"""Session: requests with the same session key go to the same replica (its cache holds the history),
by consistent hashing with bounded load (Mirrokni, Thorup, Zadimoghaddam 2018).

The key is the `x-session-id` header, else the body's `user`. Each replica owns `virtual_nodes` points
on a hash ring; a key goes to the first replica clockwise from its own hash whose load is under
`ceil(load_factor * (total load + 1) / replicas)`, so a hot session spills to its ring neighbour
instead of overloading one replica, and replicas joining or leaving move only their share of keys.
Requests without a key go to the least loaded replica.

In a fleet larger than the router's sample, the router passes the key's first replicas on the ring of the
whole fleet (`RequestFeatures.preferred`, from `preferred`) with a sample of the rest: the key keeps its
replica, the load bound is judged against the sample's mean load, and the decision costs the same at 64
replicas as at 8.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from dpserve.policies.base import Decision, Need, Policy, ReplicaView, RequestFeatures, Sampling, pick_least_loaded

NEAR_OWNERS = 4
"""A key's replicas, in ring order over the whole fleet, that a sampled decision considers before the least loaded."""


def ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, replica_ids: Sequence[str], virtual_nodes: int) -> None:
        points = sorted((ring_hash(f"{rid}#{v}"), rid) for rid in replica_ids for v in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._owners = [rid for _, rid in points]

    def walk(self, key: str) -> Iterator[str]:
        """Distinct replicas in ring order, starting at the key's position (lazily: the walk usually
        stops at the first)."""
        start = bisect.bisect(self._hashes, ring_hash(key))
        seen: set[str] = set()
        count = len(self._owners)
        for step in range(count):
            owner = self._owners[(start + step) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner


class SessionAffinity(Policy):
    name = "session"
    needs = frozenset({Need.SESSION})
    sampling = Sampling.WINDOW

    def __init__(self, rng: random.Random | None = None, load_factor: float = 1.25, virtual_nodes: int = 64) -> None:
        self._rng = rng or random.Random()
        self.load_factor = load_factor
        self.virtual_nodes = virtual_nodes
        # Rings by candidate set: rebuilt only when the set of healthy replicas changes.
        self._rings: OrderedDict[tuple[str, ...], HashRing] = OrderedDict()
        self._last_ids: tuple[str, ...] = ()
        self._last_ring = HashRing((), virtual_nodes)
        self._last_owners: tuple[str, tuple[str, ...], tuple[str, ...]] = ("", (), ())

    def preferred(self, features: RequestFeatures, fleet: tuple[str, ...]) -> tuple[str, ...]:
        """The key's first replicas on the ring of the whole fleet."""
        key = features.session_key
        if not key:
            return ()
        if features.bound is not None:
            owners = self.owners(key, fleet, NEAR_OWNERS)
            return (features.bound, *(rid for rid in owners if rid != features.bound))
        # Asked twice per sampled decision (to widen the sample, then to choose): the last answer is kept.
        last_key, last_fleet, owners = self._last_owners
        if key != last_key or fleet is not last_fleet:
            owners = self.owners(key, fleet, NEAR_OWNERS)
            self._last_owners = (key, fleet, owners)
        return owners

    def owners(self, key: str, fleet: tuple[str, ...], limit: int) -> tuple[str, ...]:
        """The first `limit` distinct replicas from the key's place on the ring of `fleet` (sorted ids)."""
        return tuple(itertools.islice(self.ring(fleet).walk(key), limit))

    def ring(self, replica_ids: tuple[str, ...]) -> HashRing:
        if replica_ids is self._last_ids:  # the registry hands out the same tuple until the fleet changes
            return self._last_ring
        ring = self._rings.get(replica_ids)
        if ring is None:
            ring = self._rings[replica_ids] = HashRing(replica_ids, self.virtual_nodes)
            if len(self._rings) > 16:
                self._rings.popitem(last=False)
        self._last_ids, self._last_ring = replica_ids, ring
        return ring

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> Decision:
        key = features.session_key
        if not key:
            return Decision(pick_least_loaded(candidates, self._rng).id, "no_key")
        by_id = {c.id: c for c in candidates}
        capacity = math.ceil(self.load_factor * (sum(c.load for c in candidates) + 1) / len(candidates))
        bound = by_id.get(features.bound) if features.bound is not None else None
        if bound is not None and bound.load < capacity:
            return Decision(bound.id, "session")
        if features.preferred:
            for position, rid in enumerate(features.preferred):
                owner = by_id.get(rid)
                if owner is not None and owner.load < capacity:
                    return Decision(rid, "session" if position == 0 else "overflow")
            # Every near owner is full, gone or tried.
            return Decision(pick_least_loaded(candidates, self._rng).id, "overflow")
        first = None
        for position, rid in enumerate(self.ring(tuple(sorted(by_id))).walk(key)):
            first = first or rid
            if by_id[rid].load < capacity:
                return Decision(rid, "session" if position == 0 else "overflow")
        assert first is not None
        return Decision(first, "session")  # unreachable: the least loaded is always under capacity
