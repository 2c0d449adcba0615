"""Active probing of replicas: health, served models, and the load metrics policies read."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from dpserve.background import cancel_and_wait
from dpserve.replicas.access import KEY_REFUSED, tls_refusal
from dpserve.replicas.adapters import LORA_INFO, lora_info
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.replicas.registry import Replica, ReplicaRegistry

log = logging.getLogger("dpserve.monitor")

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
CACHE_CONFIG = "vllm:cache_config_info"
SCRAPED_METRICS = frozenset({RUNNING, WAITING, KV_USAGE, PREFIX_QUERIES, PREFIX_HITS, CACHE_CONFIG, LORA_INFO})


class ReplicaMonitor:
    """Probes every replica each `interval_s`: /health, then /metrics, and /v1/models when needed. Health and
    load go to the registry, models and adapter slots to the catalog. `session` is the replicas' own
    (`ReplicaAccess.client_session`: their key and TLS); a replica that refuses it is marked misconfigured,
    and read again each probe (/v1/models, which vLLM's key guards, included) until it accepts it."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        catalog: ModelCatalog,
        session: aiohttp.ClientSession,
        interval_s: float,
        timeout_s: float,
        models_refresh_s: float = 30.0,
        held: Callable[[], bool] = lambda: False,
        held_interval_s: float = 0.1,
    ) -> None:
        """`held`: whether the router holds requests now; while it does, replicas full only because of load
        that is not the routers' are read again every `held_interval_s` (`_watch_held`)."""
        self._registry = registry
        self._catalog = catalog
        self._held = held
        self._held_interval_s = held_interval_s
        self._held_task: asyncio.Task[None] | None = None
        self._session = session
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._models_every = max(1, round(models_refresh_s / interval_s))
        self._task: asyncio.Task[None] | None = None
        self._engines_found: Callable[[Replica, list[int]], Awaitable[None]] | None = None

    def on_engines(self, handler: Callable[[Replica, list[int]], Awaitable[None]]) -> None:
        """`handler(replica, ranks)`: the replica's metrics name several engines: it is a vLLM
        data-parallel server, and each engine can be routed to as a replica of its own."""
        self._engines_found = handler

    async def probe_all(self, tick: int = 0) -> None:
        await asyncio.gather(*(self._probe(replica, tick) for replica in self._registry))

    async def probe_now(self, replica: Replica) -> None:
        """One probe outside the schedule: a replica added at run time is routable at once if up."""
        await self._probe(replica, 0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="replica-monitor")
        if self._held_interval_s > 0:
            self._held_task = asyncio.create_task(self._watch_held(), name="replica-monitor-held")

    async def stop(self) -> None:
        await cancel_and_wait(self._held_task)
        await cancel_and_wait(self._task)

    async def _watch_held(self) -> None:
        """While requests are held: a replica full only because of load that is not the routers' (a client
        straight at it, a router without peers) is read again, since no answer of this router's will say
        when that load ends; the scrape wakes the held requests (`ReplicaRegistry.on_change`). A replica
        full of the routers' own requests needs none: their answers' ends wake them (and reading it too
        changed when a killed replica's streams were cut, in the chaos test)."""
        while True:
            await asyncio.sleep(self._held_interval_s)
            if not self._held():
                continue
            busy = [replica for replica in self._registry if replica.routable and _full_of_others(replica)]
            if busy:
                await asyncio.gather(*(self._rescrape(replica) for replica in busy))

    async def _rescrape(self, replica: Replica) -> None:
        try:
            await self._scrape(replica, scheduled=False)
        except (aiohttp.ClientError, TimeoutError, ProbeFailed, ValueError) as exc:
            # Health is the scheduled probe's to judge; this read only refreshes the load.
            log.debug("reading /metrics of held-up replica %s failed: %s", replica.id, _describe(exc))

    async def _run(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(self._interval_s)
            tick += 1
            await self.probe_all(tick)

    async def _probe(self, replica: Replica, tick: int) -> None:
        try:
            async with self._session.get(f"{replica.url}/health", timeout=self._timeout) as resp:
                _check(resp, "/health")
            # A replica coming back may have been restarted with another model: re-read its models.
            stale = not replica.healthy or not replica.models or replica.misconfigured is not None
            if stale or tick % self._models_every == 0:
                self._catalog.set_model_cards(replica.id, await self._model_cards(replica))
            await self._scrape(replica)
        except EnginesFound as found:
            assert self._engines_found is not None
            await self._engines_found(replica, found.ranks)
            return
        except Misconfigured as exc:
            self._registry.set_misconfigured(replica.id, exc.cause)
            return
        except (aiohttp.ClientError, TimeoutError, ProbeFailed, ValueError) as exc:
            cause = tls_refusal(exc)
            if cause is not None:
                self._registry.set_misconfigured(replica.id, cause)
                return
            refused = isinstance(exc, aiohttp.ClientConnectorError)  # as the request path counts UpstreamConnectError
            self._registry.probe_failed(replica.id, _describe(exc), refused)
            return
        except Exception as exc:
            # Whatever a replica answers, the probe loop must live on: it is what re-admits replicas.
            log.exception("probing replica %s failed unexpectedly", replica.id)
            self._registry.probe_failed(replica.id, _describe(exc))
            return
        self._registry.set_misconfigured(replica.id, None)
        self._registry.probe_succeeded(replica.id)

    async def _model_cards(self, replica: Replica) -> tuple[dict[str, Any], ...]:
        async with self._session.get(f"{replica.url}/v1/models", timeout=self._timeout) as resp:
            _check(resp, "/v1/models")
            payload = orjson.loads(await resp.read())
        data = payload.get("data") if isinstance(payload, dict) else None
        cards = tuple(card for card in data or () if isinstance(card, dict) and card.get("id"))
        if not cards:
            raise ProbeFailed("/v1/models lists no model")
        return cards

    async def _scrape(self, replica: Replica, scheduled: bool = True) -> None:
        async with self._session.get(f"{replica.url}/metrics", timeout=self._timeout) as resp:
            _check(resp, "/metrics")
            text = await resp.text()
        samples = parse_samples(text, SCRAPED_METRICS)
        if replica.rank is not None:
            samples = samples.of_engine(replica.rank)
        elif self._engines_found is not None and len(ranks := samples.engines(RUNNING)) > 1:
            raise EnginesFound(ranks)
        cache_config = samples.first_labels(CACHE_CONFIG) or {}
        block_size, kv_blocks = cache_config.get("block_size"), cache_config.get("num_gpu_blocks")
        self._registry.record_scrape(
            replica.id,
            running=int(samples.total(RUNNING) or 0),
            waiting=int(samples.total(WAITING) or 0),
            kv_usage=float(samples.total(KV_USAGE) or 0.0),
            prefix_cache_queries=samples.total(PREFIX_QUERIES) or 0.0,
            prefix_cache_hits=samples.total(PREFIX_HITS) or 0.0,
            block_size=int(block_size) if block_size and block_size.isdigit() else None,
            kv_blocks=int(kv_blocks) if kv_blocks and kv_blocks.isdigit() else None,
            scheduled=scheduled,
        )
        lora = lora_info(samples.by_name.get(LORA_INFO, ()))
        if lora is not None:
            max_loras, active = lora
            # vLLM logs the metric on engine steps only: an idle replica keeps showing its last batch.
            idle = not samples.total(RUNNING) and not samples.total(WAITING)
            self._catalog.set_lora_info(replica.id, max_loras, frozenset() if idle else active)


def _full_of_others(replica: Replica) -> bool:
    """At its learned capacity only because of load that is not the routers': the routers' own requests
    alone leave room, so only a fresh read can tell when the rest ends."""
    capacity = replica.capacity
    routers = replica.in_flight + replica.peer_in_flight
    # load = the routers' requests + the rest, so the rest is what fills it.
    return bool(capacity) and routers < capacity <= replica.load


class ProbeFailed(Exception):
    pass


class EnginesFound(ProbeFailed):
    """Not a failure: the replica is a data-parallel server of these engines (a read between probes that
    finds it leaves the split to the next probe)."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"engines {ranks}")
        self.ranks = ranks


class Misconfigured(Exception):
    """The replica refused the router's key: not a health failure, the router's (or the replica's) setup."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


def _check(resp: aiohttp.ClientResponse, path: str) -> None:
    if resp.status == 401:
        raise Misconfigured(KEY_REFUSED)
    if resp.status != 200:
        raise ProbeFailed(f"{path} answered {resp.status}")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
