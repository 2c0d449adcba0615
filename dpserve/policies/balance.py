"""The guard that keeps cache affinity from piling work onto one replica while others idle."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dpserve.policies.base import ReplicaSnapshot


@dataclass(frozen=True, slots=True)
class BalanceGuard:
    relative: float = 1.5
    absolute: int = 4

    def limit(self, candidates: Sequence[ReplicaSnapshot]) -> float:
        """The most load a replica may carry and still be chosen for cache affinity."""
        return self.relative * min(c.load for c in candidates) + self.absolute

    def allowed(self, candidates: Sequence[ReplicaSnapshot]) -> list[ReplicaSnapshot]:
        """Candidates within the limit (the least loaded always is)."""
        limit = self.limit(candidates)
        return [c for c in candidates if c.load <= limit]
