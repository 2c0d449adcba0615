"""Active probing of replicas: health, served models, and the load metrics policies read."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from dpserve.background import CpuMeter, cancel_and_wait
from dpserve.replicas.access import KEY_REFUSED
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
SLICES = 20
"""A probe cycle is cut into this many slices (fewer with fewer replicas): each replica is probed in its own."""
CONFIRM_GAP_S = 0.1
"""Between the probes in a row that confirm a replica whose KV-event stream dropped."""
QUIET_MODELS_EVERY = 10
"""A quiet replica whose KV-event stream is connected has its /v1/models read every this many of its visits: a
model loaded on it straight (not through the router) shows within minutes; a restart drops the stream."""


class ReplicaReads(Protocol):
    """How the monitor reads a replica: GET `path` of the replica at `base_url`, (status, body) once the whole
    answer is in. ProbeFailed when no answer came, in time or at all; Misconfigured when the replica refused
    the router's TLS."""

    async def get(self, base_url: str, path: str) -> tuple[int, bytes]: ...


@dataclass(frozen=True)
class Visit:
    """What one visit reads of a replica besides /health."""

    metrics: bool
    models: bool | None = None
    """Whether /v1/models is read; None: every `models_refresh_s` (a linked quiet replica has its own)."""


FULL = Visit(metrics=True)
HEALTH_ONLY = Visit(metrics=False)


class ReplicaMonitor:
    """Probes every replica each `interval_s`: /health, then /metrics, and /v1/models when needed. Health and
    load go to the registry, models and adapter slots to the catalog. `reads` send the replicas' key and TLS;
    a replica that refuses them is marked misconfigured, and read again each probe (/v1/models, which vLLM's
    key guards, included) until it accepts them.

    The probes are spread over the interval (`SLICES` slices, each replica in one), not sent all at once.
    A quiet replica (`quiet`: healthy, nothing running or waiting at its last read, no request of this
    router's or its peers' on it, no KV event since that read) is read only every `quiet_interval_s`: its
    /metrics would say nothing new. While its KV-event stream is connected (`events_link`), it is read less
    still: its /health alone every `linked_quiet_interval_s` (/v1/models every QUIET_MODELS_EVERY visits): a
    replica that dies drops that connection and is probed at once, `confirm_probes` times in a row (as many as
    ejecting takes), and work on it that stores a block, from any client, shows as events, so its /metrics
    would say nothing new. Anything that stirs it brings it back to every interval."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        catalog: ModelCatalog,
        reads: ReplicaReads,
        interval_s: float,
        models_refresh_s: float = 30.0,
        held: Callable[[], bool] = lambda: False,
        held_interval_s: float = 0.1,
        quiet_interval_s: float = 0.0,
        confirm_probes: int = 2,
        linked_quiet_interval_s: float = 0.0,
        probes_cpu: CpuMeter | None = None,
        scrapes_cpu: CpuMeter | None = None,
    ) -> None:
        """`held`: whether the router holds requests now; while it does, replicas full only because of load
        that is not the routers' are read again every `held_interval_s` (`_watch_held`). `quiet_interval_s`
        0 (or not above `interval_s`): every replica read every interval."""
        self._registry = registry
        self._catalog = catalog
        self._held = held
        self._held_interval_s = held_interval_s
        self._held_task: asyncio.Task[None] | None = None
        self._reads = reads
        self._interval_s = interval_s
        self._models_every = max(1, round(models_refresh_s / interval_s))
        self._quiet_every = max(1, round(quiet_interval_s / interval_s)) if interval_s > 0 else 1
        linked_every = round(linked_quiet_interval_s / interval_s) if interval_s > 0 else 1
        self._linked_quiet_every = max(self._quiet_every, linked_every)
        self._confirm_probes = confirm_probes
        self._probed: dict[str, int] = {}
        """Per replica, the cycle of its last /health, /metrics and /v1/models read (`_visits`)."""
        self._scraped: dict[str, int] = {}
        self._models_read: dict[str, int] = {}
        self._probing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._engines_found: Callable[[Replica, list[int]], Awaitable[None]] | None = None
        self.stats = ProbeStats()
        self.probes_cpu = probes_cpu or CpuMeter()
        """The schedule and the visits, but for their reads of /metrics: those are `scrapes_cpu`'s."""
        self.scrapes_cpu = scrapes_cpu or CpuMeter()

    def on_engines(self, handler: Callable[[Replica, list[int]], Awaitable[None]]) -> None:
        """`handler(replica, ranks)`: the replica's metrics name several engines: it is a vLLM
        data-parallel server, and each engine can be routed to as a replica of its own."""
        self._engines_found = handler

    async def probe_all(self) -> None:
        """Every replica at once, in full (before serving: the fleet routable from the first request)."""
        await asyncio.gather(*(self.probes_cpu.run(self._probe(replica, 0)) for replica in self._registry))

    async def probe_now(self, replica: Replica) -> None:
        """One probe outside the schedule: a replica added at run time is routable at once if up."""
        await self.probes_cpu.run(self._probe(replica, 0))

    def events_seen(self, replica_id: str) -> None:
        """A KV-event batch came from the replica: it is not quiet until read again."""
        replica = self._registry.find(replica_id)
        if replica is not None:
            replica.events_at = time.monotonic()

    def events_link(self, replica_id: str, up: bool) -> None:
        """Its KV-event stream connected (`up`) or dropped. Dropped while it is in routing: probed at once,
        as many times in a row as ejecting takes, if it keeps failing (a dead replica is out within a
        fraction of a second, not at its next scheduled probe)."""
        replica = self._registry.find(replica_id)
        if replica is None:
            return
        replica.events_linked = up
        if not up and replica.healthy:
            self._spawn(self._confirm(replica), f"replica-confirm-{replica_id}")

    async def _confirm(self, replica: Replica) -> None:
        for attempt in range(self._confirm_probes):
            if attempt:
                await asyncio.sleep(CONFIRM_GAP_S)
            if not replica.healthy or self._registry.find(replica.id) is not replica:
                return
            await self._probe(replica, 0)
            if replica.health.probe_failures == 0:
                return  # it answered: the stream only reconnects

    def start(self) -> None:
        self._task = asyncio.create_task(self.probes_cpu.run(self._run()), name="replica-monitor")
        if self._held_interval_s > 0:
            watch = self.scrapes_cpu.run(self._watch_held())
            self._held_task = asyncio.create_task(watch, name="replica-monitor-held")

    async def stop(self) -> None:
        await cancel_and_wait(self._held_task)
        await cancel_and_wait(self._task)
        for task in list(self._tasks):
            await cancel_and_wait(task)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(self.probes_cpu.run(work), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
                await asyncio.gather(*(self.scrapes_cpu.run(self._rescrape(replica)) for replica in busy))

    async def _rescrape(self, replica: Replica) -> None:
        try:
            await self._scrape(replica, scheduled=False)
        except (ProbeFailed, Misconfigured, ValueError) as exc:
            # Health is the scheduled probe's to judge; this read only refreshes the load.
            log.debug("reading /metrics of held-up replica %s failed: %s", replica.id, _describe(exc))

    async def _run(self) -> None:
        """Cycle after cycle of `interval_s`, each cut into slices: the replicas of a slice are visited at its
        start (`_visit`), so probes go out evenly over the interval, whatever the fleet's size."""
        loop = asyncio.get_running_loop()
        cycle, next_at = 0, loop.time()
        while True:
            cycle += 1
            replicas = list(self._registry)
            slices = max(1, min(len(replicas), SLICES))
            for part in range(slices):
                next_at = max(next_at + self._interval_s / slices, loop.time() - self._interval_s)
                await asyncio.sleep(next_at - loop.time())
                self._visit(replicas[part::slices], cycle)
            if len(self._probed) > 2 * len(replicas) + 16:  # replicas removed: forget their cycles
                alive = {replica.id for replica in replicas}
                for book in (self._probed, self._scraped, self._models_read):
                    for rid in [rid for rid in book if rid not in alive]:
                        del book[rid]

    def _visit(self, replicas: Sequence[Replica], cycle: int) -> None:
        """Probes those of `replicas` that are due this cycle, not waiting for the answers (a replica whose
        last probe has not ended yet is left for the next cycle)."""
        due = []
        for replica in replicas:
            if replica.id in self._probing:
                continue
            visit = self._due(replica, cycle)
            if visit is not None:
                due.append((replica, visit))
        self.stats.skipped += len(replicas) - len(due)
        if due:
            self._spawn(self._probe_some(due, cycle), "replica-probes")

    def _due(self, replica: Replica, cycle: int) -> Visit | None:
        """What this cycle reads of the replica (None: nothing)."""
        every = self._quiet_every
        if every <= 1 or not quiet(replica):
            return FULL
        rid = replica.id
        if replica.events_linked:  # its events would show work, its stream's drop a death: /health, seldom
            every = self._linked_quiet_every
            if cycle - self._probed.get(rid, 0) < every:
                return None
            return Visit(False, models=cycle - self._models_read.get(rid, 0) >= every * QUIET_MODELS_EVERY)
        return FULL if cycle - self._scraped.get(rid, 0) >= every else HEALTH_ONLY

    async def _probe_some(self, due: list[tuple[Replica, Visit]], cycle: int) -> None:
        ids = [replica.id for replica, _ in due]
        self._probing.update(ids)
        try:
            meter = self.probes_cpu
            await asyncio.gather(*(meter.run(self._probe(replica, cycle, visit)) for replica, visit in due))
        finally:
            self._probing.difference_update(ids)

    async def _probe(self, replica: Replica, cycle: int, visit: Visit = FULL) -> None:
        """`cycle` 0: outside the schedule (at start, a replica added or suspected): read in full."""
        rid = replica.id
        self._probed[rid] = cycle
        self.stats.probes += 1
        alive = False
        try:
            _check(await self._reads.get(replica.url, "/health"), "/health")
            alive = True
            # A replica coming back may have been restarted with another model: re-read its models.
            stale = not replica.healthy or not replica.models or replica.misconfigured is not None
            models = visit.models
            if models is None:
                models = cycle - self._models_read.get(rid, 0) >= self._models_every
            if stale or not cycle or models:
                self._models_read[rid] = cycle
                self._catalog.set_model_cards(rid, await self._model_cards(replica))
            if visit.metrics or stale:
                self._scraped[rid] = cycle
                await self.scrapes_cpu.run(self._scrape(replica))
        except EnginesFound as found:
            assert self._engines_found is not None
            await self._engines_found(replica, found.ranks)
            return
        except Misconfigured as exc:
            self._registry.set_misconfigured(rid, exc.cause)
            if alive:  # it answers, refusing only the router's key: healthy the moment the key in force is its own
                self._registry.probe_succeeded(rid)
            return
        except (ProbeFailed, ValueError) as exc:
            refused = isinstance(exc, ProbeFailed) and exc.refused  # as the request path counts a refused connect
            self._registry.probe_failed(rid, _describe(exc), refused)
            return
        except Exception as exc:
            # Whatever a replica answers, the probe loop must live on: it is what re-admits replicas.
            log.exception("probing replica %s failed unexpectedly", rid)
            self._registry.probe_failed(rid, _describe(exc))
            return
        self._registry.set_misconfigured(rid, None)
        self._registry.probe_succeeded(rid)

    async def _model_cards(self, replica: Replica) -> tuple[dict[str, Any], ...]:
        self.stats.models += 1
        payload = orjson.loads(_check(await self._reads.get(replica.url, "/v1/models"), "/v1/models"))
        data = payload.get("data") if isinstance(payload, dict) else None
        cards = tuple(card for card in data or () if isinstance(card, dict) and card.get("id"))
        if not cards:
            raise ProbeFailed("/v1/models lists no model")
        return cards

    async def _scrape(self, replica: Replica, scheduled: bool = True) -> None:
        self.stats.scrapes += 1
        text = _check(await self._reads.get(replica.url, "/metrics"), "/metrics").decode()
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


def quiet(replica: Replica) -> bool:
    """Nothing to read on it: in routing and answering, nothing running or waiting at its last read, no
    request of this router's or its peers' on it, and no KV event from it since that read."""
    read = replica.last_scrape
    return (
        read is not None
        and replica.routable
        and not replica.in_flight
        and not replica.peer_in_flight
        and not replica.running
        and not replica.waiting
        and not replica.health.probe_failures
        and (replica.events_at is None or replica.events_at < read)
    )


@dataclass
class ProbeStats:
    """Reads sent since start, and replica visits skipped because the replica was quiet."""

    probes: int = 0
    scrapes: int = 0
    models: int = 0
    skipped: int = 0


def _full_of_others(replica: Replica) -> bool:
    """At its learned capacity only because of load that is not the routers': the routers' own requests
    alone leave room, so only a fresh read can tell when the rest ends."""
    capacity = replica.capacity
    routers = replica.in_flight + replica.peer_in_flight
    # load = the routers' requests + the rest, so the rest is what fills it.
    return bool(capacity) and routers < capacity <= replica.load


class ProbeFailed(Exception):
    """A read got no answer, or not the one wanted; `refused`: nothing listens where it should (a refused
    connection)."""

    def __init__(self, cause: str, refused: bool = False) -> None:
        super().__init__(cause)
        self.refused = refused


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


def _check(answer: tuple[int, bytes], path: str) -> bytes:
    """The body of a 200 answer to `path`."""
    status, body = answer
    if status == 401:
        raise Misconfigured(KEY_REFUSED)
    if status != 200:
        raise ProbeFailed(f"{path} answered {status}")
    return body


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
