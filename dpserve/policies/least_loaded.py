"""Least loaded: the replica with the fewest requests in flight or queued, ties broken at random."""

from __future__ import annotations

import random
from collections.abc import Sequence

from dpserve.policies.base import ReplicaSnapshot, RequestFeatures


class LeastLoaded:
    name = "least_loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        # Random ties: "always the first" piles every burst onto replica 0 (a known peer failure).
        self._rng = rng or random.Random()

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaSnapshot]) -> ReplicaSnapshot:
        best = min(c.load for c in candidates)
        tied = [c for c in candidates if c.load == best]
        if len(tied) == 1:
            return tied[0]
        # Among equal loads, prefer the emptier KV cache before falling back to chance.
        least_kv = min(c.kv_usage for c in tied)
        tied = [c for c in tied if c.kv_usage <= least_kv + 1e-9]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)
