"""`--discover`: the fleet follows DNS. Every `--discover-interval`, and at once after a discovered replica
refused a connection, each source is looked up again; a new address is added and probed like any replica
(KV events at its `--discover-kv-port`), a vanished one drained and removed once its requests are done.

A lookup that fails keeps that source's last good answer: a DNS hiccup never empties the fleet. It shows
in /status (`discovery`) and in `dpserve_discovery_*` metrics. Replicas given by `--replica` or the admin
API are never touched; a discovered one removed through the admin API comes back while DNS names it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.background import cancel_and_wait
from dpserve.replicas.discovery import DiscoveryError, DiscoverySource
from dpserve.router.control.admin import FleetControl
from dpserve.router.http.errors import OpenAIError

log = logging.getLogger(__name__)

MIN_LOOKUP_GAP_S = 0.5
"""A burst of refused connections is one lookup, not one per request."""
DRAIN_CHECK_S = 0.25
"""How often a vanished replica is checked for its last request to finish."""
DRAIN_GRACE_S = 60.0
"""A vanished replica is removed after this even with requests in flight (they still finish)."""


class Resolver(Protocol):
    async def replica_urls(self, source: DiscoverySource) -> frozenset[str]: ...


@dataclass
class SourceState:
    """One `--discover` source: its last good answer and how its lookups went."""

    source: DiscoverySource
    urls: frozenset[str] | None = None
    error: str | None = None
    last_success: float | None = None  # wall clock
    lookups: int = 0
    failures: int = 0

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "source": str(self.source),
            "replicas": sorted(self.urls or ()),
            "ok": self.error is None and self.urls is not None,
            "error": self.error,
            "seconds_since_success": None if self.last_success is None else round(now - self.last_success, 1),
            "lookups": self.lookups,
            "failures": self.failures,
        }


class Discovery:
    def __init__(
        self,
        states: list[SourceState],
        resolver: Resolver,
        fleet: FleetControl,
        interval_s: float,
        kv_port: int,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._states = states
        self._resolver = resolver
        self._fleet = fleet
        self._registry = fleet.registry
        self._interval = interval_s
        self._kv_port = kv_port
        self._clock = clock
        self._wall = wall
        self._owned: set[str] = set()  # the URLs of the replicas this added (a server's engines share one)
        self._leaving: dict[str, float] = {}  # url -> when it left DNS
        self._poked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        fleet.registry.on_refused(self._refused)

    def _refused(self, replica_id: str) -> None:
        replica = self._registry.find(replica_id)
        if replica is not None and replica.url in self._owned:
            self._poked.set()

    def poke(self) -> None:
        """Look up every source now (well, within MIN_LOOKUP_GAP_S)."""
        self._poked.set()

    async def refresh(self) -> None:
        """One round: look every source up, then add, drain and remove to match."""
        await asyncio.gather(*(self._lookup(state) for state in self._states))
        desired = frozenset().union(*(state.urls for state in self._states if state.urls is not None))
        await self._apply(desired)

    async def _lookup(self, state: SourceState) -> None:
        state.lookups += 1
        try:
            urls = await self._resolver.replica_urls(state.source)
        except DiscoveryError as exc:
            state.failures += 1
            if state.error != str(exc):
                kept = len(state.urls or ())
                log.warning("discovery %s failed (%s): keeping its last %d replica(s)", state.source, exc, kept)
            state.error = str(exc)
            return
        if state.urls != urls:
            log.info("discovery %s: %s", state.source, ", ".join(sorted(urls)))
        state.urls, state.error, state.last_success = urls, None, self._wall()

    async def _apply(self, desired: frozenset[str]) -> None:
        for url in sorted(desired - self._owned):
            if self._registry.at_url(url):
                continue  # given by --replica or the admin API: not ours to manage
            try:
                replica = await self._fleet.add(url, None, self._kv_events(url))
            except OpenAIError as exc:
                log.warning("discovered replica %s not added: %s", url, exc.message)
                continue
            self._owned.add(url)
            log.info("replica %s discovered at %s", replica.id, url)
        for url in sorted(self._owned):
            replicas = self._registry.at_url(url)
            if not replicas:  # removed through the admin API
                self._owned.discard(url)
                self._leaving.pop(url, None)
            elif url in desired and url in self._leaving:
                del self._leaving[url]
                for replica in replicas:
                    self._fleet.drain(replica.id, False)
                log.info("replica %s is back in DNS: resumed", url)
            elif url not in desired and url not in self._leaving:
                self._leaving[url] = self._clock()
                for replica in replicas:
                    self._fleet.drain(replica.id, True)
                log.info("replica %s left DNS: draining", url)
        await self._remove_drained()

    async def _remove_drained(self) -> None:
        now = self._clock()
        for url, since in list(self._leaving.items()):
            replicas = self._registry.at_url(url)
            if sum(replica.in_flight for replica in replicas) > 0 and now - since < DRAIN_GRACE_S:
                continue
            for replica in replicas:
                await self._fleet.remove(replica.id)
                log.info("replica %s removed: gone from DNS", replica.id)
            del self._leaving[url]
            self._owned.discard(url)

    def _kv_events(self, url: str) -> str | None:
        if self._fleet.kv_index is None:
            return None
        host = urlsplit(url).netloc.rpartition(":")[0]
        return f"tcp://{host}:{self._kv_port}"

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="discovery")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        next_lookup = self._clock() + self._interval
        last_lookup = self._clock()
        while True:
            wait = next_lookup - self._clock()
            if self._leaving:
                wait = min(wait, DRAIN_CHECK_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poked.wait(), max(wait, 0.0))
            try:
                if self._poked.is_set() or self._clock() >= next_lookup:
                    await asyncio.sleep(max(0.0, last_lookup + MIN_LOOKUP_GAP_S - self._clock()))
                    self._poked.clear()
                    last_lookup = self._clock()
                    next_lookup = last_lookup + self._interval
                    await self.refresh()
                else:
                    await self._remove_drained()
            except Exception:  # a bug here must not end discovery for good
                log.exception("discovery round failed")


class DiscoveryCollector(Collector):
    """`dpserve_discovery_*`, per source, read from its state at scrape time."""

    def __init__(self, states: list[SourceState]) -> None:
        self._states = states

    def collect(self) -> Iterator[Metric]:
        lookups = CounterMetricFamily(
            "dpserve_discovery_lookups", "DNS lookups per --discover source", labels=["source"]
        )
        failures = CounterMetricFamily(
            "dpserve_discovery_failures", "Failed lookups (the last good answer was kept)", labels=["source"]
        )
        replicas = GaugeMetricFamily(
            "dpserve_discovery_replicas", "Replicas in the source's last good answer", labels=["source"]
        )
        stale = GaugeMetricFamily(
            "dpserve_discovery_stale",
            "1 while the source's last lookup failed (its last good answer is used)",
            labels=["source"],
        )
        for state in self._states:
            label = [str(state.source)]
            lookups.add_metric(label, state.lookups)
            failures.add_metric(label, state.failures)
            replicas.add_metric(label, len(state.urls or ()))
            stale.add_metric(label, 1 if state.error is not None else 0)
        yield from (lookups, failures, replicas, stale)
