"""Round robin: each replica in turn, whatever the load."""

from __future__ import annotations

from collections.abc import Sequence

from dpserve.policies.base import ReplicaSnapshot, RequestFeatures


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaSnapshot]) -> ReplicaSnapshot:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return chosen
