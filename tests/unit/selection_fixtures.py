"""A fleet of ready replicas and a Selector over it, for decisions tested without sockets."""

from __future__ import annotations

import random

from dpserve.kvindex.index import KvIndex
from dpserve.policies import RequestFeatures, make_policy
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.health import HealthRules
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.flow.admission import Admission
from dpserve.router.observe.metrics import RouterMetrics
from dpserve.router.routing.selection import PrefixLookup, Selector

MODEL = "m"
REQUEST = RequestFeatures("completions", MODEL, False)


def fleet(count: int) -> tuple[ReplicaRegistry, ModelCatalog]:
    registry = ReplicaRegistry([f"r{i}=http://127.0.0.1:{30000 + i}" for i in range(count)], HealthRules())
    catalog = ModelCatalog(registry)
    for replica in registry:
        registry.probe_succeeded(replica.id)
        catalog.set_model_cards(replica.id, ({"id": MODEL},))
    return registry, catalog


def selector(
    registry: ReplicaRegistry,
    catalog: ModelCatalog,
    policy_name: str,
    sample: int = 8,
    limit: int = 256,
    kv_index: KvIndex | None = None,
) -> Selector:
    policy = make_policy(policy_name, random.Random(1))
    metrics = RouterMetrics(registry, policy.name)
    return Selector(
        registry,
        catalog,
        policy,
        Admission(limit, 16, 1.0),
        metrics,
        PrefixLookup(metrics, kv_index),
        rng=random.Random(2),
        sample_size=sample,
    )
