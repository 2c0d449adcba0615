"""Routing policies: pure functions of request features and replica snapshots, no I/O."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from dpserve.policies.balance import BalanceGuard
from dpserve.policies.base import (
    Decision,
    Need,
    Policy,
    PrefixMatch,
    PrefixSource,
    ReplicaSnapshot,
    ReplicaView,
    RequestFeatures,
    Sampling,
    Slo,
)
from dpserve.policies.kv_aware import KvAware, KvAwareWeights
from dpserve.policies.least_loaded import LeastLoaded
from dpserve.policies.prefix import PrefixAffinity
from dpserve.policies.round_robin import RoundRobin
from dpserve.policies.session import SessionAffinity
from dpserve.policies.slo import SloAware


@dataclass(frozen=True, slots=True)
class PolicyTuning:
    """The knobs of the affinity policies (from RouterSettings; defaults documented in each policy)."""

    kv_weights: KvAwareWeights = field(default_factory=KvAwareWeights)
    guard: BalanceGuard = field(default_factory=BalanceGuard)
    prefix_min_match: float = 0.5
    session_load_factor: float = 1.25
    slo_inner: str = "least_loaded"
    """What `slo` chooses with among the replicas predicted to meet an SLO: kv_aware where the replicas
    publish KV events, else least_loaded."""
    slo_headroom: float = 1.0
    slo_first: bool = False
    """The replicas serve requests with an SLO first (`--vllm-priority`)."""


_FACTORIES: dict[str, Callable[[random.Random, PolicyTuning], Policy]] = {
    "round_robin": lambda rng, tuning: RoundRobin(),
    "least_loaded": lambda rng, tuning: LeastLoaded(rng),
    "kv_aware": lambda rng, tuning: KvAware(rng, tuning.kv_weights, tuning.guard),
    "prefix": lambda rng, tuning: PrefixAffinity(rng, tuning.prefix_min_match, tuning.guard),
    "session": lambda rng, tuning: SessionAffinity(rng, tuning.session_load_factor),
    "slo": lambda rng, tuning: SloAware(
        make_policy(tuning.slo_inner, rng, tuning), tuning.guard, tuning.slo_headroom, tuning.slo_first
    ),
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def make_policy(name: str, rng: random.Random | None = None, tuning: PolicyTuning | None = None) -> Policy:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    return factory(rng or random.Random(), tuning or PolicyTuning())


__all__ = [
    "POLICY_NAMES",
    "Decision",
    "Need",
    "Policy",
    "PolicyTuning",
    "PrefixMatch",
    "PrefixSource",
    "ReplicaSnapshot",
    "ReplicaView",
    "RequestFeatures",
    "Sampling",
    "Slo",
    "make_policy",
]
