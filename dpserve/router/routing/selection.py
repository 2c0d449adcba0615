"""Choosing a replica for one request: the candidates (routable, untried, with room), a sample of them in
a large fleet, what each holds of the prompt, and the policy's pick. No I/O: tests and the decision-time
benchmark call it directly."""

from __future__ import annotations

import random
from collections.abc import Sequence

from dpserve.kvindex.index import KvIndex
from dpserve.kvindex.recent import RecentRoutes
from dpserve.kvindex.text_prefix import TextPrefixIndex
from dpserve.policies.adapters import AdapterSlots, Placement, place
from dpserve.policies.balance import BalanceGuard
from dpserve.policies.base import Decision, Policy, PrefixSource, ReplicaView, RequestFeatures, Sampling
from dpserve.policies.bindings import SessionBindings
from dpserve.policies.slo import SloAware
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.registry import Replica, ReplicaRegistry
from dpserve.router.flow.admission import Admission
from dpserve.router.observe.life import Choice
from dpserve.router.observe.metrics import RouterMetrics


class Selector:
    def __init__(
        self,
        registry: ReplicaRegistry,
        catalog: ModelCatalog,
        policy: Policy,
        admission: Admission,
        metrics: RouterMetrics,
        prefixes: PrefixLookup | None = None,
        rng: random.Random | None = None,
        sample_size: int = 0,
        bindings: SessionBindings | None = None,
        adapter_affinity: bool = True,
        guard: BalanceGuard | None = None,
    ) -> None:
        """`sample_size` > 0: a policy that allows it (`Policy.sampling`) sees at most that many replicas
        of a larger fleet, so a decision costs the same with 64 replicas as with 8. `adapter_affinity`
        False: LoRA requests ignore where adapters are loaded (a baseline; `--lora-affinity off`)."""
        self._adapter_affinity = adapter_affinity
        self._guard = guard or BalanceGuard()
        """How much busier than the least loaded a replica holding an adapter may be (`--balance-*`)."""
        self.policy = policy
        self._registry = registry
        self._catalog = catalog
        self._admission = admission
        self._metrics = metrics
        self._prefixes = prefixes
        """None for a policy that reads no prefix: nothing to look up or record."""
        self._rng = rng or random.Random()
        self._sampling = policy.sampling if sample_size > 0 else Sampling.ALL
        self._sample_size = sample_size
        self._bindings = bindings
        """The session policy's: each keyed request binds its session to where it went."""

    def candidates(self, features: RequestFeatures, tried: Sequence[str] = ()) -> list[ReplicaView]:
        """Replicas the policy may choose from now: routable, untried, with room; a sample of them in a
        large fleet, the whole fleet only when none in the sample has room (or all are backing off).
        Replicas on a degraded GPU only when no other has room. For a LoRA adapter, those that hold it,
        or the one that should load it (`policies/adapters.py`)."""
        found = self._candidates(features, tried)
        if features.adapter is None or not found:  # none with room: not an adapter question
            return found
        # Where it is loaded counts also while full: the request may wait for that replica.
        fleet = self._registry.available(self._catalog.routable(features.model), tried)
        return list(self._place(features.adapter, found, fleet).candidates)

    def _candidates(self, features: RequestFeatures, tried: Sequence[str]) -> list[ReplicaView]:
        registry, admission = self._registry, self._admission
        degraded = registry.degraded_ids
        view = self._catalog.routable(features.model)
        pool = self._sample(view, features)
        if len(pool) < len(view):
            fresh = registry.available(pool, tried, fresh_only=True)
            candidates = admission.open(fresh, features.priority, features.slo is not None)
            if degraded:
                candidates = [c for c in candidates if c.id not in degraded]
            if candidates:
                return candidates
        candidates = admission.open(registry.available(view, tried), features.priority, features.slo is not None)
        if degraded:
            fit = [c for c in candidates if c.id not in degraded]
            return fit or candidates
        return candidates

    def _place(self, adapter: str, candidates: Sequence[ReplicaView], fleet: Sequence[ReplicaView]) -> Placement:
        registry = self._registry
        slots: dict[str, AdapterSlots] = {}
        for member in fleet:
            replica = registry.find(member.id)
            if replica is not None:
                slots[member.id] = self._catalog.adapter_slots_of(replica)
        placement = place(adapter, candidates, slots, self._admission.holds, self._adapter_affinity, self._guard, fleet)
        self._metrics.labeled(self._metrics.adapter_placements, placement.reason).inc()
        return placement

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> Choice:
        """The policy's pick among `candidates` (not empty), counted and remembered where it went, with the
        snapshot it was made from (for the request's life: its receipt and the shadows read it there)."""
        policy, prefixes = self.policy, self._prefixes
        if prefixes is not None:
            features = prefixes.match(features, candidates)
        fleet = self._catalog.routable_ids(features.model)
        if len(candidates) < len(fleet):  # a sample, or some tried or full: the policy's own view of the fleet
            preferred = policy.preferred(features, fleet)
            if preferred:
                features = features.with_preferred(preferred)
        decision = policy.choose(features, candidates)
        metrics = self._metrics
        metrics.decision_reasons.add((policy.name, decision.reason))
        slo = features.slo
        if not decision.meets_slo and slo is not None and not slo.queue:  # refused: it goes nowhere
            return Choice(policy.name, decision, features, candidates, 0)
        metrics.decisions.add((policy.name, decision.id))
        if prefixes is not None:
            prefixes.record(features, decision.id)
        if self._bindings is not None and features.session_key:
            self._bindings.bind(features.session_key, decision.id)
        chosen = self._registry.find(decision.id)
        engine_block = (chosen.block_size or 0) if chosen is not None else 0
        return Choice(policy.name, decision, features, candidates, engine_block)

    def too_late(self, features: RequestFeatures, tried: Sequence[str], wait_s: float) -> float | None:
        """For a request with an SLO that finds no replica with room, expected to wait `wait_s` in the
        router's queue and then go to a free slot: its soonest first token predicted, when even the nearest
        replica misses the SLO so (it should not wait for a refusal at its deadline); None when it may wait,
        or the policy predicts no time."""
        policy, slo = self.policy, features.slo
        if not isinstance(policy, SloAware) or slo is None:
            return None
        fleet = self._registry.available(self._catalog.routable(features.model), tried)
        if not fleet:
            return None
        if self._prefixes is not None:
            features = self._prefixes.match(features, fleet)
        ttft, nearest = min(
            ((policy.predict_ttft(features, r, when_free=True), r) for r in fleet), key=lambda pair: pair[0]
        )
        ttft += wait_s
        return None if policy.meets(slo, ttft, nearest) else ttft

    def decide(self, features: RequestFeatures, tried: Sequence[str] = ()) -> Decision | None:
        """The decision alone, as a dispatch makes it when a replica has room (for measuring it)."""
        candidates = self.candidates(features, tried)
        return self.choose(features, candidates).decision if candidates else None

    def _sample(self, view: Sequence[Replica], features: RequestFeatures) -> Sequence[Replica]:
        size, sampling, count = self._sample_size, self._sampling, len(view)
        if sampling is Sampling.ALL or count <= 1 or (sampling is Sampling.WINDOW and count <= size):
            return view
        # What the policy itself prefers (the next in turn; a session's ring owners), then for a window the
        # replicas likely to hold the prompt's prefix (together at most half the sample), then a window at
        # a random offset: every replica is as likely to be in it, at O(size) cost.
        wanted = count if sampling is Sampling.TURN else size // 2
        preferred = self.policy.preferred(features, self._catalog.routable_ids(features.model))[:wanted]
        if sampling is Sampling.WINDOW and self._prefixes is not None:
            preferred += tuple(self._prefixes.likely_best(features, wanted - len(preferred)))
        pool: list[Replica] = []
        for rid in preferred:
            replica = self._registry.find(rid)
            if replica is not None and replica.routable and features.model in replica.models:
                pool.append(replica)
        if sampling is Sampling.TURN:
            return pool
        wanted = size - len(pool)
        start = self._rng.randrange(count)
        window = list(view[start : start + wanted])
        if len(window) < wanted:
            window += view[: wanted - len(window)]
        if pool:
            likely = {replica.id for replica in pool}
            return pool + [replica for replica in window if replica.id not in likely]
        return window


class PrefixLookup:
    """What the router knows of where prompts' prefixes are cached, read at decision time: features carry
    a prompt's block keys (`routing/features.py`); this reads, for the candidates of one decision, how many leading
    blocks each holds (the KV index fed by the replicas' events, plus what was routed in the last seconds;
    or the router's own record of routed text), which replicas are likely to hold the most (so a sample of
    a large fleet does not miss them), and records where each prompt went."""

    def __init__(
        self,
        metrics: RouterMetrics,
        kv_index: KvIndex | None = None,
        text_index: TextPrefixIndex | None = None,
        recent: RecentRoutes | None = None,
    ) -> None:
        self._metrics = metrics
        self._kv_index = kv_index
        self._text_index = text_index
        self._recent = recent

    def match(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> RequestFeatures:
        """The prefix matches and cache ownership as they are now, for these candidates (cheap, sync):
        requests tokenized side by side must see each other's routing."""
        prefix = features.prefix
        if prefix is None:
            return features
        ids = [c.id for c in candidates]
        if prefix.source is PrefixSource.ROUTED_TEXT:
            if self._text_index is None:
                return features
            matched = self._text_index.match(prefix.keys, ids)
            return features.with_prefix(prefix.with_matches(matched))
        if self._kv_index is None:
            return features
        matched = self._kv_index.match(prefix.keys, ids)
        held = {rid: self._kv_index.blocks(rid) for rid in ids}
        peers = 0
        if self._recent is not None:
            # What was just sent somewhere counts as cached there: its events are a prefill away.
            pending = self._recent.match(prefix.keys, ids)
            matched = {rid: max(blocks, pending[rid]) for rid, blocks in matched.items()}
            held = {rid: blocks + self._recent.pending_blocks(rid) for rid, blocks in held.items()}
            peers = self._recent.peers
        return features.with_prefix(prefix.with_matches(matched, held, peers))

    def likely_best(self, features: RequestFeatures, limit: int) -> list[str]:
        """Replicas likely to hold the longest run of the prompt."""
        prefix = features.prefix
        if prefix is None or not prefix.keys:
            return []
        if prefix.source is PrefixSource.ROUTED_TEXT:
            return self._text_index.likely_best(prefix.keys, limit) if self._text_index is not None else []
        found = self._kv_index.likely_best(prefix.keys, limit) if self._kv_index is not None else []
        if self._recent is not None:
            found += [rid for rid in self._recent.likely_best(prefix.keys, limit) if rid not in found]
        return found

    def record(self, features: RequestFeatures, replica_id: str) -> None:
        """Once the policy chose: the approximate indexes learn where the prompt went."""
        prefix = features.prefix
        if prefix is None:
            return
        if prefix.source is PrefixSource.ROUTED_TEXT and self._text_index is not None:
            self._text_index.record(prefix.keys, replica_id)
        elif prefix.source is PrefixSource.KV_EVENTS and self._recent is not None:
            self._recent.record(prefix.keys, replica_id)
        predicted = prefix.blocks(replica_id) * prefix.tokens_per_block
        self._metrics.predicted_cached_tokens.observe((prefix.source.value,), predicted)
