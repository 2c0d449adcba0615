"""Shadow policies (`--shadow-policy NAME`): on every decision the live policy makes, each shadow policy is
asked what it would have chosen, from the same snapshot of the candidates' load; no traffic goes where a
shadow points.

What a shadow would have gained or lost in cached tokens cannot be read off the live fleet's KV index: the
replicas' caches hold what the *live* policy put there. So each shadow keeps caches of its own, a model of
what each replica would hold had the shadow routed every request: per replica, an LRU of the prompts'
block keys, as large as that replica's KV cache (`num_gpu_blocks` from its metrics; unbounded until read).
A shadow that reads prefixes (kv_aware) decides on those modelled caches too, so it routes in its own
world. A request's estimated hit is what vLLM would count: the leading blocks held there, at most all
but the block of the prompt's last token. The live policy's own choices run through the same model, so
its estimate can be held against what the replicas report (the model's error, shown beside the shadows).

Load is the one thing shared with the live world: the shadow sees the live fleet's load, not the load
its own choices would have made (reported: the mean load of the replicas it chose, and its spread).

Pure bookkeeping on the event loop, no I/O. It costs each shadow's decision and a model update per
request, so it is off unless asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.kvindex.modelled import ModelledCaches, cacheable_blocks
from dpserve.policies.base import Need, Policy, PrefixMatch, PrefixSource, ReplicaView, RequestFeatures

SHADOW_NEEDS = frozenset({Need.KV_PREFIX})
"""What a shadow may read: the prompt's KV blocks (answered from its own modelled caches), or load alone.
The text and session policies keep state the live routing writes (routed text, session bindings)."""


@dataclass(slots=True)
class ShadowTally:
    decisions: int = 0
    agreed: int = 0
    """Decisions the same as the live policy's."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Estimated on the modelled caches."""
    load: int = 0
    """Sum of the chosen replicas' load when chosen."""
    by_replica: dict[str, int] = field(default_factory=dict)

    def to_dict(self, replicas: int) -> dict[str, Any]:
        """`replicas`: how many the decisions were made among (the fair share's divisor)."""
        decisions = self.decisions
        return {
            "decisions": decisions,
            "agreed": self.agreed,
            "estimated_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "prompt_tokens": self.prompt_tokens,
            "estimated_cached_tokens": self.cached_tokens,
            "mean_load": self.load / decisions if decisions else None,
            "max_share": max(self.by_replica.values()) * replicas / decisions if decisions else None,
            "by_replica": dict(sorted(self.by_replica.items())),
        }


@dataclass(slots=True)
class Shadow:
    name: str
    policy: Policy | None
    """None: the live policy's own choices, run through the model (its estimate, for the model's error)."""
    caches: ModelledCaches = field(default_factory=ModelledCaches)
    tally: ShadowTally = field(default_factory=ShadowTally)


class ShadowScorer:
    def __init__(self, policies: Sequence[Policy], capacity_of: Callable[[str], int]) -> None:
        """`capacity_of(replica)`: its KV cache in blocks, 0 while not known."""
        for policy in policies:
            if not policy.needs <= SHADOW_NEEDS:
                raise ValueError(
                    f"--shadow-policy {policy.name}: a shadow reads load or KV blocks only "
                    "(round_robin, least_loaded, kv_aware)"
                )
        self.shadows = [Shadow(policy.name, policy) for policy in policies]
        self.live = Shadow("live", None)
        self._capacity_of = capacity_of
        self._replicas: set[str] = set()
        """Every replica a decision was made among: a policy that never chose one still had it to choose."""

    @property
    def needs(self) -> frozenset[Need]:
        needs: frozenset[Need] = frozenset()
        for shadow in self.shadows:
            assert shadow.policy is not None
            needs |= shadow.policy.needs
        return needs

    def observe(self, features: RequestFeatures, candidates: Sequence[ReplicaView], live: str) -> None:
        """The live policy chose `live` among `candidates` for a request with these features."""
        prefix = features.prefix
        kv = prefix if prefix is not None and prefix.source is PrefixSource.KV_EVENTS and prefix.keys else None
        self._replicas.update(c.id for c in candidates)
        for shadow in self.shadows:
            policy = shadow.policy
            assert policy is not None
            seen = features
            if kv is not None:
                caches = shadow.caches
                matched = {c.id: caches.leading(c.id, kv.keys) for c in candidates}
                held = {c.id: caches.blocks(c.id) for c in candidates}
                seen = replace(features, prefix=replace(kv, matched=matched, held=held))
            chosen = policy.choose(seen, candidates).id
            self._count(shadow, kv, chosen, candidates, live)
        self._count(self.live, kv, live, candidates, live)

    def _count(
        self, shadow: Shadow, kv: PrefixMatch | None, chosen: str, candidates: Sequence[ReplicaView], live: str
    ) -> None:
        tally = shadow.tally
        tally.decisions += 1
        tally.agreed += chosen == live
        tally.by_replica[chosen] = tally.by_replica.get(chosen, 0) + 1
        for candidate in candidates:
            if candidate.id == chosen:
                tally.load += candidate.load
                break
        if kv is None:
            return
        cacheable = cacheable_blocks(kv.total_blocks, kv.prompt_tokens, kv.tokens_per_block)
        hit = min(shadow.caches.leading(chosen, kv.keys), cacheable)
        tally.prompt_tokens += kv.prompt_tokens or kv.total_blocks * kv.tokens_per_block
        tally.cached_tokens += hit * kv.tokens_per_block
        shadow.caches.add(chosen, kv.keys, self._capacity_of(chosen))

    def status(self) -> dict[str, Any]:
        """For /status: each shadow's tally, and the live policy's through the same model."""
        replicas = len(self._replicas)
        return {
            "live_modelled": self.live.tally.to_dict(replicas),
            "shadows": {shadow.name: shadow.tally.to_dict(replicas) for shadow in self.shadows},
        }


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
