"""KV-aware: the replica whose KV cache already holds most of the prompt, weighed against its load.

Cost of sending the request to replica r (lowest wins):

    cost(r) = (1 - cached_blocks(r) / prompt_blocks)      # share of the prompt r must prefill
            + load_weight * load(r)                       # requests in flight or queued on r
            + kv_weight * kv_usage(r)                     # how full r's KV cache is (0..1)
            + held_weight * held(r)                       # only for a new prefix (below): what r holds
                          / max(mean(held), kv_blocks(r)) # of the fleet's cached blocks (1 = average), or
                                                          # of its own cache where that is larger

`cached_blocks` comes from the KV index (the replicas' own events), `load` is the router's fresh
in-flight count plus what the replica reports for other clients. With the default load_weight 0.05,
twenty more requests in flight outweigh recomputing the whole prompt (0.1 moved a few requests of a
hot group off its replica in `dpserve bench policies` and lost hits; the balance guard, not this
weight, is what keeps one replica from taking all the load). A prompt shorter than one block
has nothing to reuse and goes by load alone.

The `held` term decides where a new prefix (a new group, a new conversation: no replica holds half of
the prompt) settles: on the replica that owns the least of what the fleet has cached (blocks from the
index plus blocks routed in the last seconds), as the Rust routers send a miss to their smallest tree;
against its own cache's size (`num_gpu_blocks`) where that is larger than the mean holding, so that while
every cache has room the load decides.
By load alone, new groups landed by chance, one replica came to own 5 groups of 8 and, under cache
pressure, evicted its own prefixes (`dpserve bench policies`: 0.94 of the oracle; see docs/benchmarks/policies.md).
Warm requests leave it out, so owning a lot never pushes a request away from its own cached prefix. It
weighs only among replicas within `new_prefix_loads` requests of the lightest, and of those the ones with a
free slot: a replica that just joined owns nothing, and would otherwise take every new prefix until the
balance guard stopped it, far past what it runs at once. A router alone puts it on the least-held of those
(near-equal loads aside); a router with peers draws it by its own hash in proportion to
exp(-(cost - lowest) / `peer_spread`), so new prefixes reaching several routers at once spread, most to the
cheapest replica, instead of all going to one, and routers whose costs differ a little draw each alike
(nearly always: `drawn_by_hash`).

Two guards: replicas over the balance limit (see `BalanceGuard`) are not chosen while others are,
so a popular prefix cannot overload its replica; and an optional softmax temperature spreads choices
among near-equal costs. At 0, the lowest cost wins; costs within `tie_loads` requests' load of it are a tie,
won by the replica the prefix's own block key hashes highest with (rendezvous, see `_tie_key`): a new prefix
whose first requests reach several routers at the same moment lands on one replica, where each router's
own count of the load (a request or two apart between peers) or a random pick split it. A prompt under one
block has no key: exact ties go to the lighter load, then at random.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from dpserve.policies.balance import BalanceGuard
from dpserve.policies.base import Decision, Need, Policy, PrefixMatch, ReplicaView, RequestFeatures, Sampling


@dataclass(frozen=True)
class KvAwareWeights:
    load_weight: float = 0.05
    kv_weight: float = 0.2
    held_weight: float = 1.0
    new_prefix_below: float = 0.5
    """A request whose best match covers less than this share of its prompt is a new prefix."""
    temperature: float = 0.0
    tie_loads: float = 2.0
    """Costs within this many requests' load (tie_loads * load_weight) of the lowest are a tie, broken by the
    prefix's hash (rendezvous): peered routers' counts of a replica's load differ by a request or two, and
    by their own counts they split a new prefix. Two is what peers' counts differ by, well inside the
    balance guard's allowance (see docs/benchmarks/routers.md, near-ties 2026-11-29)."""
    new_prefix_loads: float = 2.0
    """A new prefix has no cached blocks to win anywhere: it settles by ownership only among replicas within this
    many requests of the lightest load, and of those, among the ones with a free slot (under their `slots`:
    learned, sighted, else told by `--replica-max-num-seqs`) while any has one. A replica that joins owns
    nothing, so every new prefix wants it: in `dpserve bench elastic` a simulator that started on the ramp took
    14 new prefixes in 1.3 s at a capacity of 4 (the balance guard allows 8 over the lightest), 10 of them
    queued in its engine; within 2 of the lightest, a full replica still took a fifth while another ran 2 of
    its 4. Within 1 instead cost the cache-pressure workload of `dpserve bench policies` 0.98 -> 0.94 of the
    oracle (docs/benchmarks/elastic.md)."""
    peer_spread: float = 0.1
    """A router with peers (`PrefixMatch.peers`) draws a new prefix's replica by the prefix's own hash, each
    replica weighed exp(-(cost - lowest) / peer_spread) (`drawn_by_hash`): new prefixes reaching several
    routers at once spread in proportion, most to the cheapest, where the lowest cost in every router sent
    them all to one replica; and one prefix seen by routers whose costs differ a little is drawn alike. The
    tie this replaced (held costs within a quarter of the mean, broken by the hash) placed new prefixes by
    hash nearly always: 4 peered routers under cache pressure then lost 5-10% of one router's hits in 1 run
    of 5, and one router alone on 2 vLLM replicas 12-38% in some draws (docs/benchmarks/routers.md). A
    router alone draws nothing: the cheapest replica takes the prefix."""


class KvAware(Policy):
    name = "kv_aware"
    needs = frozenset({Need.KV_PREFIX})
    sampling = Sampling.WINDOW

    def __init__(
        self,
        rng: random.Random | None = None,
        weights: KvAwareWeights | None = None,
        guard: BalanceGuard | None = None,
    ) -> None:
        self._rng = rng or random.Random()
        self.weights = weights or KvAwareWeights()
        self.guard = guard or BalanceGuard()

    def cost(self, features: RequestFeatures, replica: ReplicaView, mean_held: float = 0.0) -> float:
        w = self.weights
        prefix = features.prefix
        uncached = 1.0
        held_cost = 0.0
        if prefix is not None:
            if prefix.total_blocks:
                uncached = 1.0 - prefix.blocks(replica.id) / prefix.total_blocks
            new_prefix = prefix.best < w.new_prefix_below * prefix.total_blocks
            if new_prefix and mean_held > 0:
                # Against its own cache where that is larger: holdings far below every cache's size leave
                # room everywhere, and the load decides (a replica that joined owns little and is not the
                # only one with room).
                room = max(mean_held, replica.kv_blocks)
                held_cost = w.held_weight * prefix.held.get(replica.id, 0) / room
        return uncached + w.load_weight * replica.load + w.kv_weight * replica.kv_usage + held_cost

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> Decision:
        allowed = self.guard.allowed(candidates)
        mean_held = 0.0
        if features.prefix is not None and features.prefix.held:
            mean_held = sum(features.prefix.held.get(c.id, 0) for c in candidates) / len(candidates)
        w = self.weights
        prefix = features.prefix
        new_prefix = prefix is not None and mean_held > 0 and prefix.best < w.new_prefix_below * prefix.total_blocks
        if new_prefix:
            lightest = min(c.load for c in allowed)
            near = [c for c in allowed if c.load <= lightest + w.new_prefix_loads]
            allowed = [c for c in near if not c.slots or c.load < c.slots] or near
        costs = [(self.cost(features, c, mean_held), c) for c in allowed]
        key = _tie_key(prefix, w.new_prefix_below)
        if new_prefix and prefix is not None and prefix.peers and key is not None and w.temperature == 0:
            chosen = drawn_by_hash(costs, key, w.peer_spread)
        else:
            chosen = self._pick(costs, key, w.tie_loads * w.load_weight)
        return Decision(chosen.id, _reason(features, candidates, allowed, chosen))

    def _pick(self, costs: list[tuple[float, ReplicaView]], first_key: int | None, margin: float) -> ReplicaView:
        temperature = self.weights.temperature
        if temperature > 0 and len(costs) > 1:
            lowest = min(cost for cost, _ in costs)
            weights = [math.exp(-(cost - lowest) / temperature) for cost, _ in costs]
            return self._rng.choices([c for _, c in costs], weights=weights)[0]
        lowest = min(cost for cost, _ in costs)
        if first_key is not None:  # the prompt's own pick among near-ties: routers seeing it at once agree
            near = [c for cost, c in costs if cost <= lowest + max(1e-9, margin)]
            return max(near, key=lambda c: rendezvous(first_key, c.id))
        tied = [c for cost, c in costs if cost <= lowest + 1e-9]
        if len(tied) > 1:
            least = min(c.load for c in tied)
            tied = [c for c in tied if c.load == least]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


def _tie_key(prefix: PrefixMatch | None, new_prefix_below: float) -> int | None:
    """The block key a near-tie is broken by, the same for every prompt of one prefix and in every router that
    sees the same cached blocks (a block's key names the whole prompt up to it): for a new prefix, its first
    block no replica holds; for a cached one, the last block of the cached match. Not the prompt's very first
    block: every prompt that opens alike (a chat template, a common preamble) shares it, and by it every such
    new prefix preferred the same replica."""
    if prefix is None or not prefix.keys:
        return None
    best = prefix.best
    at = best if best < new_prefix_below * prefix.total_blocks else best - 1
    return prefix.keys[min(at, len(prefix.keys) - 1)]


def drawn_by_hash(costs: Sequence[tuple[float, ReplicaView]], key: int, spread: float) -> ReplicaView:
    """Weighted rendezvous: each replica's weight exp(-(cost - lowest) / spread), and the prefix's hash with
    it a uniform draw u in (0, 1); the highest weight / -ln(u) wins, so a replica wins with probability
    proportional to its weight over the prefixes, and routers whose weights differ a little still agree on
    nearly every one (a winner changes only where two scores were that close)."""
    lowest = min(cost for cost, _ in costs)

    def score(item: tuple[float, ReplicaView]) -> float:
        cost, replica = item
        draw = (rendezvous(key, replica.id) + 1) / (HASH_RANGE + 1)  # in (0, 1]; rounded up to 1, it wins
        return math.inf if draw >= 1.0 else math.exp(-(cost - lowest) / spread) / -math.log(draw)

    return max(costs, key=score)[1]


HASH_RANGE = 2**64
"""`rendezvous` weights run over 0 .. HASH_RANGE - 1."""


def rendezvous(key: int, replica_id: str) -> int:
    """The weight of `replica_id` for the prefix whose first block is `key` (highest random weight): the
    same in every router and process (Python's own str hash is salted per process), and a replica that
    leaves moves only the prefixes it won."""
    digest = hashlib.blake2b(f"{key}:{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _reason(
    features: RequestFeatures,
    candidates: Sequence[ReplicaView],
    allowed: Sequence[ReplicaView],
    chosen: ReplicaView,
) -> str:
    """cache_hit: the best-matching replica; no_match: nothing cached anywhere (load decides);
    balance: the best match was over the balance limit; load: a better match lost on load."""
    prefix = features.prefix
    best = prefix.best if prefix is not None else 0
    if best == 0:
        return "no_match"
    assert prefix is not None
    if prefix.blocks(chosen.id) == best:
        return "cache_hit"
    if max(prefix.blocks(c.id) for c in allowed) < best:
        return "balance"
    return "load"
