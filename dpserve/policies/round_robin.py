"""Round robin: each replica in turn, whatever the load."""

from __future__ import annotations

from collections.abc import Sequence

from dpserve.policies.base import Decision, ReplicaView, RequestFeatures, Sampling


class RoundRobin:
    name = "round_robin"
    needs = frozenset()
    sampling = Sampling.TURN

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> Decision:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return Decision(chosen.id, "turn")
