"""Least loaded: the replica with the fewest requests in flight or queued, ties broken at random."""

from __future__ import annotations

import random
from collections.abc import Sequence

from dpserve.policies.base import Decision, ReplicaView, RequestFeatures, Sampling, least_loaded_of


class LeastLoaded:
    name = "least_loaded"
    needs = frozenset()
    sampling = Sampling.WINDOW

    def __init__(self, rng: random.Random | None = None) -> None:
        # Random ties: "always the first" piles every burst onto replica 0 (a known peer failure).
        self._rng = rng or random.Random()

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> Decision:
        # Among equal loads, the emptier KV cache goes first, then chance.
        tied = least_loaded_of(candidates)
        chosen = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        return Decision(chosen.id, "least_loaded")
