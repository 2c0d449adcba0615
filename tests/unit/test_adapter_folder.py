"""`--lora-dir`: the folder read by its watch (in a thread, every interval, once before serving), never by a
lookup; what the watch finds is served from its next read. No sockets."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from dpserve.replicas.adapter_folder import AdapterFolder, AdapterFolderWatch
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.http.errors import OpenAIError
from dpserve.router.routing.proxied_endpoints import resolve_model

BASE = {"id": "dpserve-tiny", "object": "model", "root": "/models/tiny", "parent": None}


def lora_catalog() -> ModelCatalog:
    """One admitted replica serving the base model with a LoRA slot."""
    registry = ReplicaRegistry(["r0=http://a:1"])
    catalog = ModelCatalog(registry, assumed_max_loras=1)
    registry.probe_succeeded("r0")
    catalog.set_model_cards("r0", (BASE,))
    return catalog


def test_the_folder_is_every_subfolder_but_hidden_ones(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert AdapterFolder(str(tmp_path)).read() == {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    with pytest.raises(OSError):
        AdapterFolder(str(tmp_path / "missing")).read()


async def test_a_refresh_hands_the_catalog_only_adapters_new_to_it(tmp_path: Path) -> None:
    catalog = ModelCatalog(ReplicaRegistry([]), adapters={"given": "/elsewhere/given"})
    (tmp_path / "a").mkdir()
    (tmp_path / "given").mkdir()  # `--lora given=...` wins over the folder's subfolder of that name
    watch = AdapterFolderWatch(AdapterFolder(str(tmp_path)), catalog)
    assert await watch.refresh() == ["a"]
    assert catalog.adapter_path("a") == str(tmp_path / "a") and catalog.adapter_path("given") == "/elsewhere/given"
    (tmp_path / "b").mkdir()
    assert await watch.refresh() == ["b"]
    assert await watch.refresh() == []


async def test_a_lookup_never_reads_the_folder_a_refresh_makes_the_adapter_servable(tmp_path: Path) -> None:
    catalog = lora_catalog()
    watch = AdapterFolderWatch(AdapterFolder(str(tmp_path)), catalog)
    await watch.refresh()
    (tmp_path / "late").mkdir()
    for _ in range(2):  # however often it is asked (the old lookup read the folder on a miss)
        with pytest.raises(OpenAIError) as missing:
            resolve_model(catalog, "late")
        assert missing.value.status == 404 and missing.value.code == "model_not_found"
    assert await watch.refresh() == ["late"]
    assert resolve_model(catalog, "late") == "late"
    assert [r.id for r in catalog.routable("late")] == ["r0"]
    assert catalog.model_cards(healthy_only=True)["late"]["parent"] == "dpserve-tiny"


async def test_an_unreadable_folder_is_warned_of_once_and_read_once_it_is_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "adapters"
    catalog = ModelCatalog(ReplicaRegistry([]))
    watch = AdapterFolderWatch(AdapterFolder(str(folder)), catalog)
    with caplog.at_level(logging.WARNING, logger="dpserve.adapters"):
        assert await watch.refresh() == [] and await watch.refresh() == []
    assert sum("cannot read the adapter folder" in r.message for r in caplog.records) == 1
    (folder / "a").mkdir(parents=True)
    assert await watch.refresh() == ["a"]


async def test_the_watch_reads_on_its_own_until_stopped(tmp_path: Path) -> None:
    catalog = ModelCatalog(ReplicaRegistry([]))
    watch = AdapterFolderWatch(AdapterFolder(str(tmp_path)), catalog, interval_s=0.01)
    watch.start()
    try:
        (tmp_path / "a").mkdir()
        for _ in range(200):  # 2 s at most; one interval is 10 ms
            if catalog.is_adapter("a"):
                break
            await asyncio.sleep(0.01)
        assert catalog.is_adapter("a")
    finally:
        await watch.stop()
    (tmp_path / "b").mkdir()
    await asyncio.sleep(0.05)  # five intervals: a running watch would have read it
    assert not catalog.is_adapter("b")
