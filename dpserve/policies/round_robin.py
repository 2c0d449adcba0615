"""Round robin: each replica in turn, whatever the load."""

from __future__ import annotations

from collections.abc import Sequence

from dpserve.policies.base import Decision, Need, Policy, ReplicaView, RequestFeatures, Sampling


class RoundRobin(Policy):
    name = "round_robin"
    needs: frozenset[Need] = frozenset()
    sampling = Sampling.TURN

    def __init__(self) -> None:
        self._turn = 0

    def preferred(self, features: RequestFeatures, fleet: tuple[str, ...]) -> tuple[str, ...]:
        # In a sampled fleet the next replica in turn is the whole sample (all of them when it has no room).
        return (fleet[self._turn % len(fleet)],) if fleet else ()

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> Decision:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return Decision(chosen.id, "turn")
