"""Least loaded: the replica with the fewest requests in flight or queued, ties broken at random."""

from __future__ import annotations

import random
from collections.abc import Sequence

from dpserve.policies.base import Decision, Need, Policy, ReplicaView, RequestFeatures, Sampling, pick_least_loaded


class LeastLoaded(Policy):
    name = "least_loaded"
    needs: frozenset[Need] = frozenset()
    sampling = Sampling.WINDOW

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> Decision:
        # Among equal loads, the emptier KV cache goes first, then chance.
        return Decision(pick_least_loaded(candidates, self._rng).id, "least_loaded")
