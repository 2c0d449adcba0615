"""What the router knows of each replica's LoRA adapters: vLLM's `vllm:lora_requests_info`, /v1/models
cards with `parent`, in-flight counts for idleness, and which replicas may serve an adapter (the catalog)."""

from __future__ import annotations

from dpserve.replicas.adapters import adapter_cards, lora_info
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.replicas.registry import ReplicaRegistry

BASE = {"id": "dpserve-tiny", "object": "model", "root": "/models/tiny", "parent": None, "created": 7}


def card(name: str, parent: str = "dpserve-tiny") -> dict[str, object]:
    return {"id": name, "object": "model", "root": f"/adapters/{name}", "parent": parent}


def ready(urls: list[str]) -> ReplicaRegistry:
    """Replicas admitted by their probes."""
    registry = ReplicaRegistry([f"r{index}={url}" for index, url in enumerate(urls)])
    for replica in registry:
        registry.probe_succeeded(replica.id)
    return registry


def test_lora_info_reads_the_newest_sample_vllm_kept() -> None:
    # As vLLM 0.32 printed it after requests to two adapters, at idle (the values are timestamps).
    text = (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.79562063714e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters="a"} 1.79562063697e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="b"} 1.7956206371e+09\n'
    )
    series = parse_samples(text, {"vllm:lora_requests_info"}).by_name["vllm:lora_requests_info"]
    assert lora_info(series) == (2, frozenset())
    assert lora_info(series[1:]) == (2, frozenset({"a", "b"}))
    assert lora_info([]) is None


def test_adapter_cards_are_those_with_a_parent() -> None:
    assert set(adapter_cards([BASE, card("a"), card("b")])) == {"a", "b"}


def test_an_adapter_is_served_by_every_replica_with_lora_on_and_listed_with_its_parent() -> None:
    registry = ready(["http://a:1", "http://b:1", "http://c:1"])
    catalog = ModelCatalog(registry, adapters={"x": "/adapters/x"})
    catalog.set_model_cards("r0", (BASE, card("y")))
    catalog.set_model_cards("r1", (BASE,))
    catalog.set_model_cards("r2", (BASE,))
    catalog.set_lora_info("r1", 2, frozenset())
    # r0 lists an adapter (LoRA on), r1 reported its slots, r2 neither: not a place for adapters.
    assert [r.id for r in catalog.routable("x")] == ["r0", "r1"]
    assert [r.id for r in catalog.routable("y")] == ["r0", "r1"]  # learned from r0's card, with its path
    assert catalog.adapter_path("y") == "/adapters/y" and catalog.adapter_path("z") is None
    assert catalog.only_model() == "dpserve-tiny"  # adapters aside
    cards = catalog.model_cards(healthy_only=True)
    assert list(cards) == ["dpserve-tiny", "y", "x"]
    assert cards["x"]["parent"] == "dpserve-tiny" and cards["x"]["root"] == "/adapters/x"
    assert catalog.adapter_parent("x") == "dpserve-tiny"
    assert registry.get("r0").lora.loaded == {"y"}


def test_an_assumed_slot_until_the_replica_reports_its_own() -> None:
    registry = ReplicaRegistry(["r0=http://a:1"])
    catalog = ModelCatalog(registry, adapters={"x": "/adapters/x"}, assumed_max_loras=1)
    replica, added = registry.get("r0"), registry.add("http://b:1")  # given at start, and added later
    assert replica.lora.max_loras == added.lora.max_loras == 1 and replica.lora.enabled
    catalog.set_lora_info("r0", 4, frozenset())
    assert replica.lora.max_loras == 4
    assert ModelCatalog(ReplicaRegistry(["r0=http://a:1"])).routable("x") == ()  # no LoRA, no adapter


def test_an_adapter_in_use_is_busy_until_its_last_request_ends() -> None:
    now = [10.0]
    registry = ReplicaRegistry(["r0=http://a:1"], clock=lambda: now[0])
    catalog = ModelCatalog(registry, assumed_max_loras=2)
    changes: list[None] = []
    registry.on_change(lambda: changes.append(None))
    catalog.set_model_cards("r0", (BASE, card("a"), card("b")))
    lora = registry.get("r0").lora
    registry.hold_adapter("r0", "a")
    registry.hold_adapter("r0", "a")
    assert lora.slots().busy == {"a"} and lora.slots().idle_victim() == "b"
    now[0] = 20.0
    registry.release_adapter("r0", "a")
    assert lora.slots().busy == {"a"} and not changes
    registry.release_adapter("r0", "a")
    assert lora.slots().busy == frozenset() and len(changes) == 1  # idle now: waiters look again
    assert lora.last_used["a"] == 20.0 and lora.slots().idle_victim() == "b"  # b was never used
    # Running or waiting on the replica (another client's request) is busy too.
    catalog.set_lora_info("r0", 2, frozenset({"b"}))
    assert lora.slots().idle_victim() == "a"
    catalog.set_lora_info("r0", 2, frozenset())
    assert len(changes) == 2  # the catalog tells the registry's listeners: a slot is free


def test_a_restarted_replica_lists_no_adapter_and_its_loads_in_progress_stay() -> None:
    registry = ReplicaRegistry(["r0=http://a:1"])
    catalog = ModelCatalog(registry, assumed_max_loras=2)
    catalog.set_model_cards("r0", (BASE, card("a")))
    lora = registry.get("r0").lora
    lora.loaded.add("b")
    lora.loading.add("b")
    catalog.set_model_cards("r0", (BASE,))
    assert lora.loaded == {"b"}


def test_a_learned_adapter_is_served_while_a_replica_lists_it_and_a_configured_one_always() -> None:
    registry = ready(["http://a:1", "http://b:1"])
    catalog = ModelCatalog(registry, adapters={"x": "/adapters/x"}, assumed_max_loras=2)
    catalog.set_model_cards("r0", (BASE, card("y")))
    catalog.set_model_cards("r1", (BASE,))
    assert catalog.is_adapter("y") and catalog.is_adapter("x") and not catalog.is_adapter("dpserve-tiny")
    assert [r.id for r in catalog.routable("y")] == ["r0", "r1"]  # r1 may load it: its path is known
    # Unloaded everywhere (an admin retiring it): no longer served or listed, not loaded back.
    catalog.set_model_cards("r0", (BASE,))
    assert not catalog.is_adapter("y") and catalog.routable("y") == ()
    assert list(catalog.model_cards(healthy_only=True)) == ["dpserve-tiny", "x"]
    assert catalog.is_adapter("x")
