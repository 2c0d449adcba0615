"""The router's Prometheus metrics, all named dpserve_* (never vllm:*, which belongs to the replicas)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from dpserve.kvindex.index import KvIndex
from dpserve.kvindex.text_prefix import TextPrefixIndex
from dpserve.replicas.kv_events import KvEventSubscriber
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.http.errors import CLIENT_CLOSED
from dpserve.router.observe.life import RequestLife, Watch
from dpserve.router.observe.prompt_tokens import TokenCache

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PREDICTION_ERROR_BUCKETS = (
    *(-b for b in (5, 2.5, 1, 0.5, 0.25, 0.1, 0.05, 0.025, 0.01)),
    0,
    *(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
TOKENIZE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


# The per-request series are kept as plain numbers and turned into Prometheus families only when scraped:
# prometheus_client's `inc` and `observe` take a lock and walk its value objects on every call (38k of 561k
# instructions a JSON request, measured with benchmarks.instructions). Requests are counted on one event loop,
# so a dict of numbers does; a scrape (in another thread) reads a copy (`_copy`). The exposition is
# prometheus_client's own families, as its Counter and Histogram print them (tests/unit/test_tallies.py).
Labels = tuple[str, ...]
_T = TypeVar("_T")


class Tally:
    """A counter family: a count per set of label values."""

    __slots__ = ("doc", "labels", "name", "values")

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.doc = doc
        self.labels = list(labels)
        # A family without labels has its one series from the start, at 0, as prometheus_client's has.
        self.values: dict[Labels, float] = {} if labels else {(): 0.0}

    def add(self, key: Labels, amount: float = 1.0) -> None:
        values = self.values
        values[key] = values.get(key, 0.0) + amount

    def value(self, key: Labels = ()) -> float:
        return self.values.get(key, 0.0)

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, value in _copy(self.values):
            family.add_metric(list(key), value)
        return family


def _copy(series: dict[Labels, _T]) -> list[tuple[Labels, _T]]:
    """The series as they are, for a scrape in another thread than the one that adds them. One C call
    copies them, but an allocation in it may start the garbage collector, whose finalizers run Python and
    may let the adding thread in: the copy then fails (seen once in the whole suite) and is taken again."""
    while True:
        try:
            return list(series.items())
        except RuntimeError:  # changed size during the copy
            continue


class _Series:
    """One histogram series: a count per bucket (not cumulative; the last is past every bound) and the sum."""

    __slots__ = ("counts", "total")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)
        self.total = 0.0


class Spread:
    """A histogram family: per set of label values, how many observations fell in each bucket, and their sum."""

    __slots__ = ("_edges", "bounds", "doc", "labels", "name", "series")

    def __init__(self, name: str, doc: str, labels: Sequence[str] = (), buckets: Iterable[float] = ()) -> None:
        self.name = name
        self.doc = doc
        self.labels = list(labels)
        self.bounds = tuple(sorted(float(b) for b in buckets))
        if not self.bounds:
            raise ValueError(f"histogram {name} needs bucket bounds")
        # `le` as prometheus_client writes it ("0.005", "1.0", "+Inf").
        self._edges = [*(floatToGoString(b) for b in self.bounds), "+Inf"]  # type: ignore[no-untyped-call]  # unannotated upstream
        self.series: dict[Labels, _Series] = {} if labels else {(): _Series(len(self.bounds))}

    def observe(self, key: Labels, value: float) -> None:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _Series(len(self.bounds))
        # A value equal to a bound belongs to that bucket (`le`): the first bound not below it.
        series.counts[bisect_left(self.bounds, value)] += 1
        series.total += value

    def count(self, key: Labels = ()) -> int:
        series = self.series.get(key)
        return sum(series.counts) if series is not None else 0

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, series in _copy(self.series):
            counts, total = list(series.counts), series.total
            cumulative, buckets = 0, []
            for edge, count in zip(self._edges, counts, strict=True):
                cumulative += count
                buckets.append((edge, float(cumulative)))
            family.add_metric(list(key), buckets, sum_value=total)
        return family


class TallyCollector(Collector):
    """Exports tallies and spreads at scrape time."""

    def __init__(self, families: Sequence[Tally | Spread]) -> None:
        self._families = tuple(families)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.family()


class RouterMetrics:
    def __init__(self, replicas: ReplicaRegistry, policy_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._answers()
        self._retries_and_adapters()
        self._admission()
        self._routing()
        self._slo()
        self.policy_name = policy_name
        # Every plain-number family declared above, exported at scrape (by dir(), not vars(): a compiled
        # instance has no __dict__).
        families = (getattr(self, name, None) for name in dir(self) if not name.startswith("__"))
        tallies = [family for family in families if isinstance(family, Tally | Spread)]
        self.registry.register(TallyCollector(tallies))
        self.registry.register(_ReplicaStateCollector(replicas))
        # The process's own: CPU, memory, open files, the interpreter and its garbage collector.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}

    def _slo(self) -> None:
        """Requests with an SLO by outcome, and how far the TTFT predictions were off."""
        self.slo_requests = Tally(
            "dpserve_slo_requests",
            "Requests that carried an SLO, by tenant, model and outcome: met, missed, or refused (no replica "
            "was predicted to meet it). Goodput is the rate of `met`.",
            ["tenant", "model", "outcome"],
        )
        self.ttft_prediction_error = Spread(
            "dpserve_ttft_prediction_error_seconds",
            "Predicted less realized time to first token of each stream on its replica (above 0: predicted "
            "too long), by replica.",
            ["replica"],
            PREDICTION_ERROR_BUCKETS,
        )

    def _answers(self) -> None:
        """What clients got: answers by status, their timing, who left, which streams broke."""
        self.requests = Tally(
            "dpserve_requests",
            "Requests answered by the router, by endpoint, model (or adapter), replica and HTTP status.",
            ["endpoint", "model", "replica", "status"],
        )
        self.duration = Spread(
            "dpserve_request_duration_seconds",
            "Time from request to the last byte relayed, by endpoint and whether it streamed.",
            ["endpoint", "stream"],
            LATENCY_BUCKETS,
        )
        self.first_byte = Spread(
            "dpserve_time_to_first_byte_seconds",
            "Time from request to the replica's first response: its first event for streams (TTFT), "
            "its headers otherwise.",
            ["endpoint", "stream"],
            LATENCY_BUCKETS,
        )
        self.client_disconnects = Counter(
            "dpserve_client_disconnects",
            "Requests whose client left before the answer was complete, by where the request was then: received "
            "(its body being read), queued (in the router, never sent), backoff (between attempts, not sent "
            "again), replica (sent, no answer yet: its connection closed, so vLLM aborts it), answering.",
            ["endpoint", "stage"],
            registry=self.registry,
        )
        self.broken_streams = Counter(
            "dpserve_broken_streams",
            "Streams cut by the replica after the first byte, ended with an SSE error event.",
            ["replica"],
            registry=self.registry,
        )

    def _retries_and_adapters(self) -> None:
        """Requests sent again elsewhere, and LoRA adapters loaded, unloaded and placed."""
        self.retries = Counter(
            "dpserve_retries",
            "Requests sent again to another replica, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.adapter_loads = Counter(
            "dpserve_lora_loads",
            "LoRA adapter loads the router asked of replicas, by replica and outcome (ok, failed, cancelled).",
            ["replica", "outcome"],
            registry=self.registry,
        )
        self.adapter_unloads = Counter(
            "dpserve_lora_unloads",
            "Idle LoRA adapters the router unloaded to free a slot, by replica and outcome.",
            ["replica", "outcome"],
            registry=self.registry,
        )
        self.adapter_load_seconds = Histogram(
            "dpserve_lora_load_seconds",
            "How long a replica took to load a LoRA adapter (requests for it wait that long).",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.adapter_placements = Counter(
            "dpserve_lora_placements",
            "Placements of LoRA adapter requests: to replicas holding the adapter (loaded, loaded_busy), to "
            "one that loads it (free_slot, evict, over_bound), or none yet (holder_full: waits for a "
            "holder's room; full: every adapter slot busy; a waiting request counts at each look), blind "
            "with --lora-affinity off.",
            ["reason"],
            registry=self.registry,
        )

    def _admission(self) -> None:
        """The admission queue and what the router refused itself."""
        self.queue_depth = Gauge(
            "dpserve_queue_depth",
            "Requests waiting in the router's admission queue for a replica with room.",
            registry=self.registry,
        )
        self.queue_oldest_wait = Gauge(
            "dpserve_queue_oldest_wait_seconds",
            "How long the request held longest in the admission queue has waited so far (0: none held).",
            registry=self.registry,
        )
        self.queue_wait = Spread(
            "dpserve_queue_wait_seconds",
            "Time requests waited for admission (0 when a replica had room at once).",
            buckets=(0, *LATENCY_BUCKETS),
        )
        self.admission_rejections = Counter(
            "dpserve_admission_rejections",
            "Requests refused with 429 by admission control, by reason (queue_full, queue_timeout).",
            ["reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "dpserve_rejected_requests",
            "Requests refused by the router itself, by HTTP status.",
            ["status"],
            registry=self.registry,
        )

    def _routing(self) -> None:
        """The policy's decisions and what it predicted."""
        self.decisions = Tally(
            "dpserve_routing_decisions", "Routing decisions, by policy and chosen replica.", ["policy", "replica"]
        )
        self.decision_reasons = Tally(
            "dpserve_routing_decision_reasons",
            "Routing decisions, by policy and the reason for the choice (cache_hit, no_match, balance, ...).",
            ["policy", "reason"],
        )
        self.predicted_cached_tokens = Spread(
            "dpserve_routing_predicted_cached_tokens",
            "Prompt tokens the chosen replica was predicted to hold in its prefix cache, per request.",
            ["source"],
            TOKEN_BUCKETS,
        )
        self.prompt_tokens = Tally(
            "dpserve_routing_prompt_tokens",
            "Prompt tokens of requests routed on KV-cache matches (the denominator of the predicted hit rate).",
        )
        self.tokenize_seconds = Spread(
            "dpserve_routing_tokenize_seconds",
            "Time to get a request's token ids for KV-aware routing (cache included), by tokenizer.",
            ["tokenizer"],
            TOKENIZE_BUCKETS,
        )

    def labeled(self, metric: MetricWrapperBase, *values: str) -> Any:
        """`metric.labels(*values)`, remembered: the hot path skips the library's lock and label checks."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def watch(self, life: RequestLife) -> RequestMetrics:
        return RequestMetrics(self, life)


class RequestMetrics(Watch):
    """One request's counts: its wait for admission, its first byte, and at the end its status (by the
    replica that answered, `none` when the router answered itself), its duration and whether its client left."""

    __slots__ = ("_life", "_metrics")

    def __init__(self, metrics: RouterMetrics, life: RequestLife) -> None:
        self._metrics = metrics
        self._life = life

    def admitted(self, waited_s: float) -> None:
        self._metrics.queue_wait.observe((), waited_s)

    def first_byte(self, replica_id: str, at: float) -> None:
        life = self._life
        self._metrics.first_byte.observe((life.endpoint, "true" if life.stream else "false"), at - life.started)

    def finished(self, life: RequestLife) -> None:
        metrics, endpoint, status = self._metrics, life.endpoint, str(life.status)
        model = life.model or "none"
        if life.refused:
            metrics.rejected.labels(status).inc()
            metrics.requests.add((endpoint, model, "none", status))
            return
        if life.status == CLIENT_CLOSED:
            metrics.client_disconnects.labels(endpoint, life.stage).inc()
        if life.replica_id is None:  # gone before any answer began
            metrics.requests.add((endpoint, model, "none", status))
            return
        metrics.requests.add((endpoint, model, life.replica_id, status))
        metrics.duration.observe((endpoint, "true" if life.stream else "false"), life.ended_at - life.started)


class _ReplicaStateCollector(Collector):
    """Replica state read at scrape time, so the hot path keeps no second copy of it."""

    def __init__(self, replicas: ReplicaRegistry) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "healthy": GaugeMetricFamily(
                "dpserve_replica_healthy", "1 when the replica is in routing (not ejected).", labels=["replica"]
            ),
            "draining": GaugeMetricFamily(
                "dpserve_replica_draining", "1 while the admin API drains the replica.", labels=["replica"]
            ),
            "degraded": GaugeMetricFamily(
                "dpserve_replica_degraded",
                "1 while the replica's GPU is degraded: it gets new requests only when no other replica has room.",
                labels=["replica"],
            ),
            "in_flight": GaugeMetricFamily(
                "dpserve_replica_in_flight_requests",
                "Requests the router has in flight on the replica.",
                labels=["replica"],
            ),
            "running": GaugeMetricFamily(
                "dpserve_replica_running_requests", "Requests running on the replica (scraped).", labels=["replica"]
            ),
            "waiting": GaugeMetricFamily(
                "dpserve_replica_waiting_requests", "Requests queued on the replica (scraped).", labels=["replica"]
            ),
            "kv_usage": GaugeMetricFamily(
                "dpserve_replica_kv_cache_usage_ratio",
                "KV-cache usage of the replica, 0..1 (scraped).",
                labels=["replica"],
            ),
            "hit_ratio": GaugeMetricFamily(
                "dpserve_replica_prefix_cache_hit_ratio",
                "Realized prefix-cache hit rate of the replica since it started: "
                "vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total (scraped).",
                labels=["replica"],
            ),
            "adapters": GaugeMetricFamily(
                "dpserve_replica_lora_adapters",
                "LoRA adapters the replica holds (or is loading), as the router knows.",
                labels=["replica"],
            ),
        }
        ejections = CounterMetricFamily(
            "dpserve_replica_ejections",
            "Times the replica was taken out of routing by failed probes or failed requests.",
            labels=["replica"],
        )
        hits = queries = 0.0
        for replica in self._replicas:
            in_routing = replica.healthy and replica.misconfigured is None
            gauges["healthy"].add_metric([replica.id], 1.0 if in_routing else 0.0)
            gauges["draining"].add_metric([replica.id], 1.0 if replica.draining else 0.0)
            gauges["degraded"].add_metric([replica.id], 1.0 if replica.degraded else 0.0)
            ejections.add_metric([replica.id], replica.health.ejections)
            gauges["in_flight"].add_metric([replica.id], replica.in_flight)
            gauges["running"].add_metric([replica.id], replica.running)
            gauges["waiting"].add_metric([replica.id], replica.waiting)
            gauges["kv_usage"].add_metric([replica.id], replica.kv_usage)
            if replica.lora.enabled:
                gauges["adapters"].add_metric([replica.id], len(replica.lora.loaded))
            if replica.prefix_cache_queries:
                ratio = replica.prefix_cache_hits / replica.prefix_cache_queries
                gauges["hit_ratio"].add_metric([replica.id], ratio)
            hits += replica.prefix_cache_hits
            queries += replica.prefix_cache_queries
        yield from gauges.values()
        yield ejections
        fleet = GaugeMetricFamily(
            "dpserve_prefix_cache_hit_ratio", "Realized prefix-cache hit rate over all replicas (scraped)."
        )
        if queries:
            fleet.add_metric([], hits / queries)
        yield fleet


class RoutingStateCollector(Collector):
    """The KV index, its event subscribers, the text prefix index and the token cache, read at scrape."""

    def __init__(
        self,
        kv_index: KvIndex | None,
        subscribers: Sequence[KvEventSubscriber],
        text_index: TextPrefixIndex | None,
        tokens: TokenCache | None,
    ) -> None:
        self._kv_index = kv_index
        self._subscribers = subscribers
        self._text_index = text_index
        self._tokens = tokens

    def collect(self) -> Iterator[Metric]:
        index = self._kv_index
        if index is not None:
            blocks = GaugeMetricFamily(
                "dpserve_kv_index_blocks", "Blocks the KV index holds for the replica.", labels=["replica"]
            )
            events = CounterMetricFamily(
                "dpserve_kv_events", "KV-cache events received, by replica and type.", labels=["replica", "type"]
            )
            gaps = CounterMetricFamily(
                "dpserve_kv_event_gaps",
                "Sequence gaps or restarts in a replica's KV events (each clears its entries).",
                labels=["replica", "kind"],
            )
            errors = CounterMetricFamily(
                "dpserve_kv_event_decode_errors", "KV-event messages that could not be decoded.", labels=["replica"]
            )
            for sub in self._subscribers:
                blocks.add_metric([sub.replica_id], index.blocks(sub.replica_id))
                for kind, count in sub.stats.by_type.items():
                    events.add_metric([sub.replica_id, kind], count)
                gaps.add_metric([sub.replica_id, "gap"], sub.stats.gaps)
                gaps.add_metric([sub.replica_id, "restart"], sub.stats.restarts)
                errors.add_metric([sub.replica_id], sub.stats.decode_errors)
            yield from (blocks, events, gaps, errors)
            yield GaugeMetricFamily("dpserve_kv_index_entries", "Entries in the KV index.", value=index.entries)
            yield GaugeMetricFamily(
                "dpserve_kv_index_max_entries", "The KV index's bound on entries.", value=index.max_entries
            )
            yield GaugeMetricFamily(
                "dpserve_kv_index_bytes", "Estimated memory of the KV index.", value=index.approx_bytes()
            )
            stats = index.stats
            for name, value, doc in (
                ("duplicate_stores", stats.duplicate_stores, "Stores of a block the replica already held."),
                ("orphan_blocks", stats.orphan_blocks, "Stored blocks dropped because their parent was unknown."),
                ("evicted_entries", stats.evicted, "Entries dropped to stay within the bound."),
                ("unknown_removals", stats.unknown_removals, "Removals of blocks the index did not hold."),
            ):
                yield CounterMetricFamily(f"dpserve_kv_index_{name}", doc, value=value)
        if self._text_index is not None:
            yield GaugeMetricFamily(
                "dpserve_prefix_index_chunks",
                "Text chunks in the approximate prefix index.",
                value=len(self._text_index),
            )
        if self._tokens is not None:
            lookups = CounterMetricFamily(
                "dpserve_token_cache_lookups", "Token-cache lookups, by result.", labels=["result"]
            )
            lookups.add_metric(["hit"], self._tokens.hits)
            lookups.add_metric(["miss"], self._tokens.misses)
            yield lookups
            yield GaugeMetricFamily(
                "dpserve_token_cache_entries",
                "Prompts whose token ids the router keeps (an LRU).",
                value=len(self._tokens),
            )
            yield CounterMetricFamily(
                "dpserve_routing_tokenize_failures",
                "Requests whose token ids could not be had (they were routed on load alone).",
                value=self._tokens.tokenizer.failures,
            )
