"""Prefix (approximate): the replica the router last sent the same leading text to, for engines that
publish no KV events. The match comes from the router's own record of what it routed where (text
chunks, see `dpserve.kvindex.text_prefix`), so it cannot see evictions; it is trusted only when a
large share of the prompt matches, and never past the balance limit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from dpserve.policies.balance import BalanceGuard
from dpserve.policies.base import Decision, Need, Policy, ReplicaView, RequestFeatures, Sampling, pick_least_loaded


class PrefixAffinity(Policy):
    name = "prefix"
    needs = frozenset({Need.TEXT_PREFIX})
    sampling = Sampling.WINDOW

    def __init__(
        self, rng: random.Random | None = None, min_match: float = 0.5, guard: BalanceGuard | None = None
    ) -> None:
        self._rng = rng or random.Random()
        self.min_match = min_match
        """The share of the prompt's chunks that must match for affinity to count."""
        self.guard = guard or BalanceGuard()

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> Decision:
        prefix = features.prefix
        if prefix is None or not prefix.total_blocks or prefix.best / prefix.total_blocks < self.min_match:
            return Decision(pick_least_loaded(candidates, self._rng).id, "no_match")
        allowed = self.guard.allowed(candidates)
        best_allowed = max(prefix.blocks(c.id) for c in allowed)
        if best_allowed / prefix.total_blocks < self.min_match:
            return Decision(pick_least_loaded(allowed, self._rng).id, "balance")
        matching = [c for c in allowed if prefix.blocks(c.id) == best_allowed]
        return Decision(pick_least_loaded(matching, self._rng).id, "cache_hit")
