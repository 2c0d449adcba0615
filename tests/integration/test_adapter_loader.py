"""The adapter loader against a scripted replica, for what real vLLM cannot be made to show on demand:
slow loads (serialized per replica, one per adapter however many requests wait), vLLM's "already loaded"
answer, and a load that fails for every waiter. Real vLLM's side is in test_lora.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.observe.metrics import RouterMetrics
from dpserve.router.routing.adapter_loader import AdapterLoader, AdapterLoadFailed
from tests.conftest import free_port

pytestmark = pytest.mark.integration


@dataclass
class ScriptedLoras:
    load_s: float = 0.2
    answers: dict[str, tuple[int, object]] = field(default_factory=dict)
    """Adapter -> (status, body) to answer its load with; 200 otherwise."""
    calls: list[tuple[str, str]] = field(default_factory=list)
    loading_now: int = 0
    most_at_once: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/load_lora_adapter", self._load)
        app.router.add_post("/v1/unload_lora_adapter", self._unload)
        return app

    async def _load(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        self.calls.append(("load", name))
        self.loading_now += 1
        self.most_at_once = max(self.most_at_once, self.loading_now)
        try:
            await asyncio.sleep(self.load_s)
        finally:
            self.loading_now -= 1
        status, body = self.answers.get(name, (200, f"Success: LoRA adapter '{name}' added successfully."))
        if isinstance(body, str):
            return web.Response(text=body, status=status)
        return web.json_response(body, status=status)

    async def _unload(self, request: web.Request) -> web.Response:
        self.calls.append(("unload", (await request.json())["lora_name"]))
        return web.Response(text="Success")


@contextlib.asynccontextmanager
async def loader_for(
    replica: ScriptedLoras, max_loras: int = 2
) -> AsyncIterator[tuple[AdapterLoader, ReplicaRegistry]]:
    port = free_port()
    runner = web.AppRunner(replica.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    paths = {name: f"/adapters/{name}" for name in ("a", "b", "c", "bad")}
    registry = ReplicaRegistry([f"r0=http://127.0.0.1:{port}"])
    catalog = ModelCatalog(registry, adapters=paths, assumed_max_loras=max_loras, adapter_slots=max_loras)
    loader = AdapterLoader(registry, catalog, RouterMetrics(registry, "least_loaded"))
    try:
        async with aiohttp.ClientSession() as session:
            loader.attach(session)
            yield loader, registry
    finally:
        await runner.cleanup()


async def test_concurrent_requests_share_one_load_and_loads_on_a_replica_never_overlap() -> None:
    replica = ScriptedLoras()
    async with loader_for(replica) as (loader, registry):
        lora = registry.get("r0").lora
        first = loader.reserve("r0", "a")
        # At decision time, before the load ends, it counts as there: the next decisions join it.
        assert first is not None and lora.loaded == {"a"} and lora.loading == {"a"}
        assert loader.reserve("r0", "a") is first
        waits = [loader.ready("r0", "a") for _ in range(5)] + [loader.ready("r0", "b") for _ in range(3)]
        await asyncio.gather(*waits)
        assert sorted(replica.calls) == [("load", "a"), ("load", "b")]
        assert replica.most_at_once == 1
        assert lora.loaded == {"a", "b"} and lora.loading == set()
        await loader.ready("r0", "a")  # held: no call
        assert len(replica.calls) == 2


async def test_already_loaded_is_loaded_and_a_failed_load_fails_every_waiter() -> None:
    missing = {"error": {"message": "Loading lora bad failed: No adapter found", "type": "NotFoundError"}}
    already = {"error": {"message": "The lora adapter 'a' has already been loaded.", "type": "InvalidUserInput"}}
    replica = ScriptedLoras(answers={"bad": (404, missing), "a": (400, already)})
    async with loader_for(replica) as (loader, registry):
        await loader.ready("r0", "a")
        results = await asyncio.gather(*(loader.ready("r0", "bad") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, AdapterLoadFailed) and "No adapter found" in r.message for r in results)
        assert registry.get("r0").lora.loaded == {"a"}
        assert replica.calls == [("load", "a"), ("load", "bad")]


async def test_a_full_replica_unloads_its_least_recently_used_idle_adapter_first() -> None:
    replica = ScriptedLoras(load_s=0.01)
    async with loader_for(replica, max_loras=2) as (loader, registry):
        await loader.ready("r0", "a")
        await loader.ready("r0", "b")
        registry.hold_adapter("r0", "a")  # a request of `a` in flight; `b` is idle
        await loader.ready("r0", "c")
        assert replica.calls[-2:] == [("unload", "b"), ("load", "c")]
        assert registry.get("r0").lora.loaded == {"a", "c"}
