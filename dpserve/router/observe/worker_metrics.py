"""One scrape, the whole router. With `--workers N` the kernel hands each scrape of `/metrics` to any one
worker; that worker answers for all of them: its own series and each sibling's (read on the sibling's
private port, `?scope=worker`), added up. Measured before: after 100 requests over 2 workers, scrapes read
38 to 62, alternating, so Prometheus saw counters reset all the time.

prometheus_client's multiprocess mode was the other way; it aggregates only the library's own metric
objects, not the collectors that read the router's state at scrape time (usage per tenant, receipts,
replica state), which would still have answered per worker.

How a series adds up over workers: a worker's own counts (requests, their timing, usage, decisions) and
its own load (in-flight requests, the queue, its memory) are summed; what each worker sees of the same
shared thing (a replica's health or ejections, the KV events each subscribed to, a GPU) is taken once, the
largest; a process start time, the earliest."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger("dpserve.router")

WORKER_SCOPE = "worker"
"""`/metrics?scope=worker`, `/status?scope=worker`: this worker's own answer alone (what its siblings read)."""
SIBLING_TIMEOUT_S = 2.0
SEEN_ALIKE = (
    "dpserve_replica_",
    "dpserve_kv_event",
    "dpserve_kv_index",
    "dpserve_discovery",
    "dpserve_gpu",
    "dpserve_prefix",
    "dpserve_token_cache_entries",
    "dpserve_peers",
)
"""Series each worker keeps of the same shared thing: taken once (the largest), not added up."""
OWN_LOAD = frozenset(
    {
        "dpserve_replica_in_flight_requests",
        "dpserve_queue_depth",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
    }
)
"""Gauges of each worker's own load: added up (other gauges are taken once)."""
EARLIEST = frozenset({"process_start_time_seconds"})


def combine(name: str, kind: str) -> Callable[[float, float], float]:
    """How two workers' values of one series (family `name`, of type `kind`) make the router's."""
    if name in EARLIEST:
        return min
    if name in OWN_LOAD:
        return _add
    if name.startswith(SEEN_ALIKE) or kind in ("gauge", "info", "stateset"):
        return max
    return _add


def _add(a: float, b: float) -> float:
    return a + b


def merge(texts: Iterable[str]) -> bytes:
    """Prometheus text from several workers' texts, each series combined by `combine`."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            how = combine(family.name, merged.type)
            series = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = series.get(key)
                series[key] = sample.value if old is None else how(old, sample.value)
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed(Collector):
    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class WorkerMetrics:
    """This worker's registry, and where its siblings answer for theirs."""

    def __init__(
        self, registry: CollectorRegistry, siblings: Sequence[str], headers: Callable[[], Mapping[str, str]] = dict
    ) -> None:
        """`headers`: the key the siblings are read with (the one in force: key files change)."""
        self._registry = registry
        self._siblings = tuple(siblings)
        self._headers = headers

    async def scrape(self, scope: str) -> bytes:
        own = generate_latest(self._registry)
        if scope == WORKER_SCOPE or not self._siblings:
            return own
        theirs = await read_siblings(self._siblings, "/metrics", self._headers())
        return merge([own.decode(), *(text for text in theirs if text is not None)])


async def read_siblings(
    siblings: Sequence[str], path: str, headers: Mapping[str, str] | None = None
) -> list[str | None]:
    """Each sibling worker's own answer at `path?scope=worker` (on its private port), in order; None where
    it did not answer 200 within SIBLING_TIMEOUT_S (restarting: left out this once). `headers`: the admin key,
    as the keys hold on the private port too."""
    timeout = aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        return list(await asyncio.gather(*(_read(session, url, path) for url in siblings)))


async def _read(session: aiohttp.ClientSession, url: str, path: str) -> str | None:
    try:
        async with session.get(f"{url}{path}", params={"scope": WORKER_SCOPE}) as response:
            return await response.text() if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("%s of worker %s not read: %s", path, url, type(exc).__name__)
        return None
