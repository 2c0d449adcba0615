"""What the router knows of each replica's LoRA adapters: vLLM's `vllm:lora_requests_info`, /v1/models
cards with `parent`, in-flight counts for idleness, and which replicas may serve an adapter."""

from __future__ import annotations

from dpserve.replicas.adapter_folder import AdapterFolder
from dpserve.replicas.adapters import adapter_cards, lora_info
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.replicas.registry import ReplicaRegistry

BASE = {"id": "dpserve-tiny", "object": "model", "root": "/models/tiny", "parent": None, "created": 7}


def card(name: str, parent: str = "dpserve-tiny") -> dict[str, object]:
    return {"id": name, "object": "model", "root": f"/adapters/{name}", "parent": parent}


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
    registry = ReplicaRegistry(["http://a:1", "http://b:1", "http://c:1"], adapters={"x": "/adapters/x"})
    for replica in registry:
        registry.probe_succeeded(replica.id)
        registry.probe_succeeded(replica.id)
    registry.set_model_cards("r0", (BASE, card("y")))
    registry.set_model_cards("r1", (BASE,))
    registry.set_model_cards("r2", (BASE,))
    registry.set_lora_info("r1", 2, frozenset())
    # r0 lists an adapter (LoRA on), r1 reported its slots, r2 neither: not a place for adapters.
    assert [r.id for r in registry.routable("x")] == ["r0", "r1"]
    assert [r.id for r in registry.routable("y")] == ["r0", "r1"]  # learned from r0's card, with its path
    assert registry.adapter_paths["y"] == "/adapters/y"
    assert registry.only_model() == "dpserve-tiny"  # adapters aside
    cards = registry.model_cards(healthy_only=True)
    assert list(cards) == ["dpserve-tiny", "y", "x"]
    assert cards["x"]["parent"] == "dpserve-tiny" and cards["x"]["root"] == "/adapters/x"
    assert registry.adapter_parent("x") == "dpserve-tiny"
    assert registry.get("r0").lora.loaded == {"y"}


def test_an_assumed_slot_until_the_replica_reports_its_own() -> None:
    registry = ReplicaRegistry(["http://a:1"], adapters={"x": "/adapters/x"}, assumed_max_loras=1)
    replica = registry.get("r0")
    assert replica.lora.max_loras == 1 and replica.lora.enabled
    registry.set_lora_info("r0", 4, frozenset())
    assert replica.lora.max_loras == 4


def test_an_adapter_in_use_is_busy_until_its_last_request_ends() -> None:
    now = [10.0]
    registry = ReplicaRegistry(["http://a:1"], clock=lambda: now[0], assumed_max_loras=2)
    changes: list[None] = []
    registry.on_change(lambda: changes.append(None))
    registry.set_model_cards("r0", (BASE, card("a"), card("b")))
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
    registry.set_lora_info("r0", 2, frozenset({"b"}))
    assert lora.slots().idle_victim() == "a"
    registry.set_lora_info("r0", 2, frozenset())
    assert len(changes) == 2


def test_a_restarted_replica_lists_no_adapter_and_its_loads_in_progress_stay() -> None:
    registry = ReplicaRegistry(["http://a:1"], assumed_max_loras=2)
    registry.set_model_cards("r0", (BASE, card("a")))
    lora = registry.get("r0").lora
    lora.loaded.add("b")
    lora.loading.add("b")
    registry.set_model_cards("r0", (BASE,))
    assert lora.loaded == {"b"}


def test_the_adapter_folder_is_every_subfolder_read_again_for_an_unknown_model(tmp_path: object) -> None:
    from pathlib import Path

    folder = Path(str(tmp_path))
    (folder / "a").mkdir()
    (folder / ".hidden").mkdir()
    (folder / "notes.txt").write_text("x")
    now = [0.0]
    registry = ReplicaRegistry([], adapter_folder=AdapterFolder(str(folder), clock=lambda: now[0]))
    assert registry.adapter_paths == {"a": str(folder / "a")}
    (folder / "b").mkdir()
    assert not registry.find_new_adapters()  # read less than a second ago
    now[0] = 1.5
    assert registry.find_new_adapters() and registry.adapter_paths["b"] == str(folder / "b")
    now[0] = 3.0
    assert not registry.find_new_adapters()
    assert AdapterFolder(str(folder / "missing")).read() == {}


def test_a_learned_adapter_is_served_while_a_replica_lists_it_and_a_configured_one_always() -> None:
    registry = ReplicaRegistry(["http://a:1", "http://b:1"], adapters={"x": "/adapters/x"}, assumed_max_loras=2)
    for replica in registry:
        registry.probe_succeeded(replica.id)
        registry.probe_succeeded(replica.id)
    registry.set_model_cards("r0", (BASE, card("y")))
    registry.set_model_cards("r1", (BASE,))
    assert registry.is_adapter("y") and registry.is_adapter("x") and not registry.is_adapter("dpserve-tiny")
    assert [r.id for r in registry.routable("y")] == ["r0", "r1"]  # r1 may load it: its path is known
    # Unloaded everywhere (an admin retiring it): no longer served or listed, not loaded back.
    registry.set_model_cards("r0", (BASE,))
    assert not registry.is_adapter("y") and registry.routable("y") == ()
    assert list(registry.model_cards(healthy_only=True)) == ["dpserve-tiny", "x"]
    assert registry.is_adapter("x")
