"""Shadow policies (`--shadow-policy NAME`): on every decision the live policy makes, each shadow policy is
asked what it would have chosen; no traffic goes where a shadow points.

What a shadow would have gained or lost in cached tokens cannot be read off the live fleet: the replicas'
caches and in-flight counts are what the *live* policy made them. So each shadow keeps a world of its own:
- caches: per replica, an LRU of the prompts' block keys, as large as that replica's KV cache
  (`num_gpu_blocks` from its metrics; unbounded until read). A shadow that reads prefixes (kv_aware)
  decides on them. A request's estimated hit is what vLLM would count: the leading blocks held there, at
  most all but the block of the prompt's last token.
- load: the requests its own choices would have in flight on each replica, plus what the replica carries
  for others (peer routers, other clients). Each choice is held while the live request runs, and longer by
  the prompt tokens it would have computed beyond the live choice's, at the prefill cost per token learned
  from the live requests (`router/quality/prefill_cost.py`): a policy that misses more keeps its replicas busier.
  Shared load would tie the shadow to the live placement (a conversation's replica frees a slot just
  before the conversation's next turn, so a least-loaded shadow on the live load followed kv_aware's
  stickiness: +0.27 hit rate over its own run), and without the longer holds its replicas looked idler
  than its own run's (+0.20).
- turn (round robin): where its turn falls for a conversation depends on how many requests arrived in
  between, which the live policy's timing decides (in lockstep, a multiple of the replica count pins every
  conversation to one replica). Its cache model takes the turn as a uniform draw over the candidates, what
  the counter gives when arrivals do not keep step, and its estimate is the mean over them; its
  decisions (spread, load, agreement) are the counter's own.
What no shadow can change is when requests arrive: clients that wait for each answer would send at the
pace the shadow's policy allowed them, not the live one's.
The live policy's own choices run through the same cache model, so its estimate can be held against what
the replicas report (the model's error, shown beside the shadows).

Pure bookkeeping on the event loop, no I/O. It costs each shadow's decision and a model update per
request, so it is off unless asked for.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.kvindex.modelled import ModelledCaches, cacheable_blocks
from dpserve.policies.base import Need, Policy, PrefixMatch, PrefixSource, ReplicaView, RequestFeatures, Sampling
from dpserve.policies.latency import ReplicaLatency
from dpserve.router.observe.life import Choice, RequestLife, Watch
from dpserve.router.quality.prefill_cost import PrefillCost

SHADOW_NEEDS = frozenset({Need.KV_PREFIX})
"""What a shadow may read: the prompt's KV blocks (answered from its own modelled caches), or load alone.
The text and session policies keep state the live routing writes (routed text, session bindings)."""


@dataclass(slots=True)
class ShadowTally:
    decisions: int = 0
    agreed: int = 0
    """Decisions the same as the live policy's."""
    prompt_tokens: int = 0
    cached_tokens: float = 0.0
    """Estimated on the modelled caches (a mean over the candidates for a turn policy: not whole)."""
    load: int = 0
    """Sum of the chosen replicas' load when chosen, in the shadow's own world."""
    by_replica: dict[str, int] = field(default_factory=dict)

    def to_dict(self, replicas: int) -> dict[str, Any]:
        """`replicas`: how many the decisions were made among (the fair share's divisor)."""
        decisions = self.decisions
        return {
            "decisions": decisions,
            "agreed": self.agreed,
            "estimated_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "prompt_tokens": self.prompt_tokens,
            "estimated_cached_tokens": round(self.cached_tokens),
            "mean_load": self.load / decisions if decisions else None,
            "max_share": max(self.by_replica.values()) * replicas / decisions if decisions else None,
            "by_replica": dict(sorted(self.by_replica.items())),
            "replicas": replicas,
        }


@dataclass(slots=True)
class Shadow:
    name: str
    policy: Policy | None
    """None: the live policy's own choices, run through the model (its estimate, for the model's error)."""
    caches: ModelledCaches = field(default_factory=ModelledCaches)
    tally: ShadowTally = field(default_factory=ShadowTally)
    in_flight: dict[str, int] = field(default_factory=dict)
    """Requests its own choices have in flight, per replica (held until the live request ends)."""
    blocks_in_use: dict[str, int] = field(default_factory=dict)
    """Their prompts' blocks: what vLLM's `kv_cache_usage_perc` counts (cached but free blocks are free)."""


@dataclass(slots=True)
class ShadowView:
    """A candidate as a shadow sees it: its own requests in flight and their blocks' share of the cache;
    the load others put there (peer routers, other clients) and the capacity as the live replica's."""

    id: str
    in_flight: int
    load: int
    kv_usage: float
    capacity: int
    confirmed_capacity: int
    slots: int
    slow_refill: bool
    latency: ReplicaLatency
    """The live replica's: a shadow's choices do not change what the replica computes."""
    peer_in_flight: int = 0
    """Peers' requests are in `load` already: a shadow never asks admission for room."""
    kv_blocks: int = 0
    """The live replica's cache size (kv_aware weighs its holdings against it)."""


class ShadowHold:
    """The shadows' choices for one live attempt: their in-flight counts drop when it ends, later for a
    choice that would have computed more of the prompt than the live one did."""

    __slots__ = ("_live_uncached", "_placed", "_scorer", "_started")

    def __init__(self, scorer: ShadowScorer, placed: list[Placed], started: float, live_uncached: float | None) -> None:
        self._scorer = scorer
        self._placed = placed
        self._started = started
        self._live_uncached = live_uncached
        """Prompt tokens the live choice computes (None: no KV blocks to count)."""

    def release(self) -> None:
        """Idempotent: the attempt's end (answer read, stream finished or failed)."""
        placed, self._placed = self._placed, []
        if placed:
            self._scorer.ended(placed, self._started, self._live_uncached)


class ShadowWatch(Watch):
    """The shadows following one request: each live decision is shown to them, and their choices for it
    end when its attempt does (the next decision, on a retry, or the request's end)."""

    __slots__ = ("_hold", "_scorer")

    def __init__(self, scorer: ShadowScorer) -> None:
        self._scorer = scorer
        self._hold: ShadowHold | None = None

    def decided(self, choice: Choice) -> None:
        if self._hold is not None:  # the attempt before this one ended without an answer
            self._hold.release()
        self._hold = self._scorer.observe(choice.features, choice.candidates, choice.decision.id)

    def finished(self, life: RequestLife) -> None:
        if self._hold is not None:
            self._hold.release()


@dataclass(slots=True)
class Placed:
    """One shadow's choice for a request in flight."""

    shadow: Shadow
    replica: str
    blocks: int
    uncached: float
    """Prompt tokens its replica would compute (a mean over the candidates for a turn policy)."""


class ShadowScorer:
    def __init__(
        self,
        policies: Sequence[Policy],
        capacity_of: Callable[[str], int],
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`capacity_of(replica)`: its KV cache in blocks, 0 while not known. `rng`: a turn policy's draws
        in the cache model."""
        for policy in policies:
            if not policy.needs <= SHADOW_NEEDS:
                raise ValueError(
                    f"--shadow-policy {policy.name}: a shadow reads load or KV blocks only "
                    "(round_robin, least_loaded, kv_aware)"
                )
        self.shadows = [Shadow(policy.name, policy) for policy in policies]
        self.live = Shadow("live", None)
        self._capacity_of = capacity_of
        self._rng = rng or random.Random()
        self._clock = clock
        self.prefill = PrefillCost()
        """Seconds per uncached prompt token, learned from the live requests' time on their replicas."""
        self._due: list[tuple[float, int, Placed]] = []
        """Shadow choices held past their live request's end, by when they end (a heap)."""
        self._sequence = 0
        self._replicas: set[str] = set()
        """Every replica a decision was made among: a policy that never chose one still had it to choose."""

    @property
    def needs(self) -> frozenset[Need]:
        needs: frozenset[Need] = frozenset()
        for shadow in self.shadows:
            assert shadow.policy is not None
            needs |= shadow.policy.needs
        return needs

    def watch(self, life: RequestLife) -> ShadowWatch:
        return ShadowWatch(self)

    def observe(self, features: RequestFeatures, candidates: Sequence[ReplicaView], live: str) -> ShadowHold:
        """The live policy chose `live` among `candidates` for a request with these features. Release the
        hold when that attempt ends."""
        now = self._clock()
        self._settle(now)
        prefix = features.prefix
        kv = prefix if prefix is not None and prefix.source is PrefixSource.KV_EVENTS and prefix.keys else None
        self._replicas.update(c.id for c in candidates)
        placed: list[Placed] = []
        blocks = kv.total_blocks if kv is not None else 0
        for shadow in self.shadows:
            policy = shadow.policy
            assert policy is not None
            views = self._views(shadow, candidates)
            seen = features
            matched: dict[str, int] | None = None
            if kv is not None:
                caches = shadow.caches
                matched = {c.id: caches.leading(c.id, kv.keys) for c in candidates}
                held = {c.id: caches.blocks(c.id) for c in candidates}
                seen = replace(features, prefix=replace(kv, matched=matched, held=held))
            chosen = policy.choose(seen, views).id
            uncached = self._count(shadow, kv, chosen, views, live, matched, policy.sampling is Sampling.TURN)
            shadow.in_flight[chosen] = shadow.in_flight.get(chosen, 0) + 1
            shadow.blocks_in_use[chosen] = shadow.blocks_in_use.get(chosen, 0) + blocks
            placed.append(Placed(shadow, chosen, blocks, uncached or 0.0))
        live_uncached = self._count(self.live, kv, live, candidates, live)
        return ShadowHold(self, placed, now, live_uncached)

    def ended(self, placed: Sequence[Placed], started: float, live_uncached: float | None) -> None:
        """A live attempt ended: its time teaches the prefill cost; each shadow's choice ends now, or as
        much later as the prompt tokens it would have computed beyond the live choice's would take."""
        now = self._clock()
        per_token = 0.0
        if live_uncached is not None:
            self.prefill.learn(live_uncached, now - started)
            per_token = self.prefill.seconds_per_token
        for choice in placed:
            extra = (choice.uncached - live_uncached) * per_token if live_uncached is not None else 0.0
            if extra > 0:
                self._sequence += 1
                heapq.heappush(self._due, (now + extra, self._sequence, choice))
            else:  # one that would have computed less ends with the live one: no earlier than what is known
                _free(choice)
        self._settle(now)

    def _settle(self, now: float) -> None:
        due = self._due
        while due and due[0][0] <= now:
            _free(heapq.heappop(due)[2])

    def _views(self, shadow: Shadow, candidates: Sequence[ReplicaView]) -> list[ShadowView]:
        own, in_use, capacity_of = shadow.in_flight, shadow.blocks_in_use, self._capacity_of
        views = []
        for c in candidates:
            mine = own.get(c.id, 0)
            capacity = capacity_of(c.id)
            views.append(
                ShadowView(
                    c.id,
                    mine,
                    mine + c.load - c.in_flight,  # the live router's own in-flight is the live policy's
                    min(1.0, in_use.get(c.id, 0) / capacity) if capacity > 0 else 0.0,
                    c.capacity,
                    c.confirmed_capacity,
                    c.slots,
                    c.slow_refill,
                    c.latency,
                    kv_blocks=c.kv_blocks,
                )
            )
        return views

    def _tally(self, shadow: Shadow, chosen: str, candidates: Sequence[ReplicaView], live: str) -> None:
        tally = shadow.tally
        tally.decisions += 1
        tally.agreed += chosen == live
        tally.by_replica[chosen] = tally.by_replica.get(chosen, 0) + 1
        for candidate in candidates:
            if candidate.id == chosen:
                tally.load += candidate.load
                break

    def _count(
        self,
        shadow: Shadow,
        kv: PrefixMatch | None,
        chosen: str,
        candidates: Sequence[ReplicaView],
        live: str,
        matched: dict[str, int] | None = None,
        turn: bool = False,
    ) -> float | None:
        """Tallies the choice; the prompt tokens it computes (None: no KV blocks to count). `matched`: each
        candidate's leading blocks in the shadow's caches, when the shadow already looked them up. `turn`:
        the counter's choice is tallied, but the cache model takes a uniform draw and the estimate is the
        mean hit over the candidates (see the module's note)."""
        self._tally(shadow, chosen, candidates, live)
        if kv is None:
            return None
        cacheable = cacheable_blocks(kv.total_blocks, kv.prompt_tokens, kv.tokens_per_block)
        if matched is None:
            matched = {chosen: shadow.caches.leading(chosen, kv.keys)}
        placed = chosen
        if turn:
            hit = sum(min(blocks, cacheable) for blocks in matched.values()) * kv.tokens_per_block / len(matched)
            placed = self._rng.choice(candidates).id
        else:
            hit = min(matched[chosen], cacheable) * kv.tokens_per_block
        prompt = kv.prompt_tokens or kv.total_blocks * kv.tokens_per_block
        tally = shadow.tally
        tally.prompt_tokens += prompt
        tally.cached_tokens += hit
        shadow.caches.add(placed, kv.keys, self._capacity_of(placed))
        return prompt - hit

    def status(self) -> dict[str, Any]:
        """For /status: each shadow's tally, and the live policy's through the same model."""
        replicas = len(self._replicas)
        return {
            "prefill_ms_per_token": round(self.prefill.seconds_per_token * 1000, 6),
            "live_modelled": self.live.tally.to_dict(replicas),
            "shadows": {shadow.name: shadow.tally.to_dict(replicas) for shadow in self.shadows},
        }


def _free(choice: Placed) -> None:
    shadow, replica = choice.shadow, choice.replica
    _take(shadow.in_flight, replica, 1)
    _take(shadow.blocks_in_use, replica, choice.blocks)


def _take(counts: dict[str, int], key: str, amount: int) -> None:
    left = counts.get(key, 0) - amount
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


class ShadowCollector(Collector):
    """dpserve_shadow_* series at scrape time."""

    def __init__(self, scorer: ShadowScorer) -> None:
        self._scorer = scorer

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "dpserve_shadow_decisions",
            "Decisions a shadow policy would have made, by policy and replica (live: the live policy's).",
            labels=["policy", "replica"],
        )
        tokens = CounterMetricFamily(
            "dpserve_shadow_tokens",
            "Prompt tokens, and the cached tokens estimated on each policy's modelled caches.",
            labels=["policy", "kind"],
        )
        agreed = CounterMetricFamily(
            "dpserve_shadow_agreed", "Shadow decisions the same as the live policy's.", labels=["policy"]
        )
        for shadow in [self._scorer.live, *self._scorer.shadows]:
            tally = shadow.tally
            for replica, count in sorted(tally.by_replica.items()):
                decisions.add_metric([shadow.name, replica], count)
            tokens.add_metric([shadow.name, "prompt"], tally.prompt_tokens)
            tokens.add_metric([shadow.name, "estimated_cached"], tally.cached_tokens)
            agreed.add_metric([shadow.name], tally.agreed)
        yield from (decisions, tokens, agreed)
