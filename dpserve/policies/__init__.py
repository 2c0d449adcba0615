"""Routing policies: pure functions of request features and replica snapshots, no I/O."""

from __future__ import annotations

import random
from collections.abc import Callable

from dpserve.policies.base import Policy, ReplicaSnapshot, RequestFeatures
from dpserve.policies.least_loaded import LeastLoaded
from dpserve.policies.round_robin import RoundRobin

_FACTORIES: dict[str, Callable[[random.Random], Policy]] = {
    "round_robin": lambda rng: RoundRobin(),
    "least_loaded": lambda rng: LeastLoaded(rng),
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def make_policy(name: str, rng: random.Random | None = None) -> Policy:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    return factory(rng or random.Random())


__all__ = ["POLICY_NAMES", "Policy", "ReplicaSnapshot", "RequestFeatures", "make_policy"]
