"""Loading a LoRA adapter on the replica a request was sent to, before the request goes there.

vLLM loads adapters at run time (`POST /v1/load_lora_adapter`, with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
Loads are serialized per replica (one engine, one loader), and concurrent requests for an adapter that
is being loaded wait on that one load. When every adapter slot is taken, the least recently used idle
adapter is unloaded first (`policies/adapters.py`). The replica's adapter set changes at once, at
decision time, so the next decision already sees the adapter there and joins its load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import orjson

from dpserve.policies.adapters import plan_load
from dpserve.replicas.access import KEY_REFUSED, tls_refusal
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.registry import Replica, ReplicaRegistry
from dpserve.router.http.upstream_client import ReplicaMisconfigured
from dpserve.router.observe.metrics import RouterMetrics

log = logging.getLogger("dpserve.adapters")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
ALREADY_LOADED = "has already been loaded"
"""vLLM's 400 for a name it holds: another router (or an earlier, unanswered load) got there first."""


class AdapterLoadFailed(Exception):
    def __init__(self, replica_id: str, adapter: str, status: int | None, message: str) -> None:
        super().__init__(f"loading adapter `{adapter}` on replica {replica_id} failed: {message}")
        self.replica_id = replica_id
        self.adapter = adapter
        self.status = status
        self.message = message


class AdapterLoader:
    def __init__(
        self,
        registry: ReplicaRegistry,
        catalog: ModelCatalog,
        metrics: RouterMetrics,
        timeout_s: float = 120.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._registry = registry
        self._catalog = catalog
        self._metrics = metrics
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._pending: dict[tuple[str, str], asyncio.Task[None]] = {}

    def attach(self, session: aiohttp.ClientSession) -> None:
        """The session the router's own calls to replicas use (made when the app starts, with their key and TLS:
        `ReplicaAccess.client_session`)."""
        self._session = session

    def reserve(self, replica_id: str, adapter: str) -> asyncio.Task[None] | None:
        """Right after the decision, before any await: None when the replica holds the adapter; else the
        load (started now, or already under way), with the replica's adapter set updated at once."""
        pending = self._pending.get((replica_id, adapter))
        if pending is not None:
            return pending
        replica = self._registry.find(replica_id)
        if replica is None or adapter in replica.lora.loaded:
            return None
        lora = replica.lora
        plan = plan_load(adapter, self._catalog.adapter_slots_of(replica))
        lora.loaded.add(adapter)
        lora.loading.add(adapter)
        if plan.evict is not None:
            lora.loaded.discard(plan.evict)
            lora.last_used.pop(plan.evict, None)
        key = (replica_id, adapter)
        task = asyncio.create_task(self._load(replica, adapter, plan.evict), name=f"load-{adapter}-{replica_id}")
        self._pending[key] = task
        task.add_done_callback(lambda done: self._done(key, done))
        return task

    async def ready(self, replica_id: str, adapter: str) -> None:
        """Returns once the replica holds the adapter (at once when it does); raises AdapterLoadFailed."""
        task = self.reserve(replica_id, adapter)
        if task is not None:
            # Shielded: a client that leaves does not cancel the load the others wait on.
            await asyncio.shield(task)

    def forget(self, replica_id: str, adapter: str) -> None:
        """The replica answered 404 for an adapter the router thought it held (it restarted, or someone
        unloaded it): the next request loads it again."""
        replica = self._registry.find(replica_id)
        if replica is not None and adapter not in replica.lora.loading:
            replica.lora.loaded.discard(adapter)
            log.info("replica %s no longer holds adapter %s; it will be loaded again", replica_id, adapter)

    def _done(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        self._pending.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: waiters got it; a load nobody waits for any more is only logged

    async def _load(self, replica: Replica, adapter: str, evict: str | None) -> None:
        lora = replica.lora
        try:
            lock = self._locks.setdefault(replica.id, asyncio.Lock())
            async with lock:
                if evict is not None:
                    await self._unload(replica, evict)
                path = self._catalog.adapter_path(adapter)
                if path is None:
                    raise AdapterLoadFailed(replica.id, adapter, None, "the router knows no path for it")
                started = self._clock()
                status, message = await self._post(replica, LOAD_PATH, {"lora_name": adapter, "lora_path": path})
                if status != 200 and not (status == 400 and ALREADY_LOADED in message):
                    raise AdapterLoadFailed(replica.id, adapter, status, message)
                seconds = self._clock() - started
        except BaseException as exc:
            lora.loaded.discard(adapter)
            outcome = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
            self._metrics.adapter_loads.labels(replica.id, outcome).inc()
            if isinstance(exc, AdapterLoadFailed):
                log.warning("%s", exc)
            raise
        finally:
            lora.loading.discard(adapter)
        self._metrics.adapter_loads.labels(replica.id, "ok").inc()
        self._metrics.adapter_load_seconds.observe(seconds)
        log.info("loaded adapter %s on replica %s in %.0f ms", adapter, replica.id, seconds * 1000)

    async def _unload(self, replica: Replica, adapter: str) -> None:
        status, message = await self._post(replica, UNLOAD_PATH, {"lora_name": adapter})
        # 404: it was not there (a restart); either way it no longer takes a slot.
        outcome = "ok" if status in (200, 404) else "failed"
        self._metrics.adapter_unloads.labels(replica.id, outcome).inc()
        if outcome == "failed":
            log.warning("unloading adapter %s on replica %s failed: %s %s", adapter, replica.id, status, message)

    async def _post(self, replica: Replica, path: str, body: dict[str, str]) -> tuple[int | None, str]:
        """The replica's status and message; ReplicaMisconfigured when it refuses the router's key or TLS."""
        session = self._session
        if session is None:
            raise AdapterLoadFailed(replica.id, body["lora_name"], None, "the router is not started")
        try:
            async with session.post(
                replica.url + path,
                data=orjson.dumps(body),
                headers={"content-type": "application/json"},
                timeout=self._timeout,
            ) as resp:
                if resp.status == 401:
                    raise ReplicaMisconfigured(KEY_REFUSED)
                return resp.status, _message(await resp.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            cause = tls_refusal(exc)
            if cause is not None:
                raise ReplicaMisconfigured(cause) from None
            return None, f"{type(exc).__name__}: {exc}"


def _message(raw: bytes) -> str:
    """vLLM answers a plain string on success and an OpenAI error object on failure."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")[:500]
    if isinstance(answer, dict):
        error = answer.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(answer.get("message"), str):
            return str(answer["message"])
    return str(answer)[:500]
