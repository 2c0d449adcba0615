"""The catalog's seam with the registry: its cached views are the same objects until the registry says who
is routable changed (`on_reshape`) or a replica's models change, and new replicas get its LoRA defaults
(`on_added`). No sockets."""

from __future__ import annotations

from collections.abc import Callable

from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.health import HealthRules, Outcome
from dpserve.replicas.registry import ReplicaRegistry

MODEL = {"id": "m", "object": "model"}
ADAPTER = {"id": "sql", "object": "model", "root": "/adapters/sql", "parent": "m"}


def serving(count: int) -> tuple[ReplicaRegistry, ModelCatalog]:
    registry = ReplicaRegistry([f"r{index}=http://h{index}:1" for index in range(count)], HealthRules(rise_threshold=1))
    catalog = ModelCatalog(registry)
    for replica in registry:
        registry.probe_succeeded(replica.id)
        catalog.set_model_cards(replica.id, (MODEL,))
    return registry, catalog


def test_views_are_kept_until_the_registry_reshapes_and_rebuilt_after() -> None:
    registry, catalog = serving(2)
    view, ids = catalog.routable("m"), catalog.routable_ids("m")
    registry.acquire("r0")
    registry.observe("r1", Outcome.OK)
    registry.record_scrape(
        "r0", running=1, waiting=0, kv_usage=0.1, prefix_cache_queries=0.0, prefix_cache_hits=0.0, block_size=16
    )
    assert catalog.routable("m") is view and catalog.routable_ids("m") is ids  # load is not routability
    changes: list[Callable[[], object]] = [
        lambda: registry.set_draining("r0", True),
        lambda: registry.set_draining("r0", False),
        lambda: registry.observe("r1", Outcome.REFUSED),
        lambda: registry.probe_succeeded("r1"),
        lambda: registry.add("http://h9:1"),
        lambda: registry.remove("h9:1"),  # named by its address
    ]
    expected = [["r1"], ["r0", "r1"], ["r0"], ["r0", "r1"], ["r0", "r1"], ["r0", "r1"]]
    for change, routable in zip(changes, expected, strict=True):
        change()
        assert catalog.routable_ids("m") is not ids and list(catalog.routable_ids("m")) == routable
        ids = catalog.routable_ids("m")


def test_a_removed_replica_takes_the_adapters_only_it_listed() -> None:
    registry, catalog = serving(2)
    catalog.set_model_cards("r1", (MODEL, ADAPTER))
    assert catalog.is_adapter("sql") and catalog.served_models() == ["m", "sql"]
    registry.remove("r1")
    assert not catalog.is_adapter("sql") and catalog.served_models() == ["m"]


def test_added_adapters_are_served_at_once_and_only_new_names_are_told() -> None:
    _, catalog = serving(1)
    catalog.set_lora_info("r0", 2, frozenset())  # LoRA on: it may load adapters
    assert not catalog.serves("sql")
    assert catalog.add_adapters({"sql": "/adapters/sql", "chat": "/adapters/chat"}) == ["sql", "chat"]
    assert catalog.serves("sql") and catalog.adapter_parent("sql") == "m"
    assert catalog.add_adapters({"sql": "/moved/sql"}) == [] and catalog.adapter_path("sql") == "/adapters/sql"
    assert catalog.only_model() == "m" and list(catalog.model_cards(healthy_only=True)) == ["m", "sql", "chat"]


def test_a_replica_reporting_lora_slots_becomes_a_place_for_adapters() -> None:
    registry, catalog = serving(2)
    catalog.add_adapters({"sql": "/adapters/sql"})
    assert catalog.routable("sql") == ()
    catalog.set_lora_info("r1", 2, frozenset())
    assert catalog.routable_ids("sql") == ("r1",)
    assert registry.get("r0").lora.max_loras == 0  # no assumed slots without LoRA configured
