"""What the router knows of where prompts' prefixes are cached, read at decision time.

Features carry a prompt's block keys (`features.py`); this reads, for the candidates of one decision,
how many leading blocks each holds (the KV index fed by the replicas' events, plus what was routed in
the last seconds; or the router's own record of routed text), which replicas are likely to hold the
most (so a sample of a large fleet does not miss them), and records where each prompt went.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from dpserve.kvindex.index import KvIndex
from dpserve.kvindex.recent import RecentRoutes
from dpserve.kvindex.text_prefix import TextPrefixIndex
from dpserve.policies.base import PrefixSource, ReplicaView, RequestFeatures
from dpserve.router.metrics import RouterMetrics


class PrefixLookup:
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
            return replace(features, prefix=replace(prefix, matched=matched))
        if self._kv_index is None:
            return features
        matched = self._kv_index.match(prefix.keys, ids)
        held = {rid: self._kv_index.blocks(rid) for rid in ids}
        if self._recent is not None:
            # What was just sent somewhere counts as cached there: its events are a prefill away.
            pending = self._recent.match(prefix.keys, ids)
            matched = {rid: max(blocks, pending[rid]) for rid, blocks in matched.items()}
            held = {rid: blocks + self._recent.pending_blocks(rid) for rid, blocks in held.items()}
        return replace(features, prefix=replace(prefix, matched=matched, held=held))

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
        self._metrics.labeled(self._metrics.predicted_cached_tokens, prefix.source.value).observe(predicted)
