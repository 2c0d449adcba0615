"""The router's Prometheus metrics, all named dpserve_* (never vllm:*, which belongs to the replicas)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.replicas.registry import ReplicaRegistry

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self, replicas: ReplicaRegistry, policy_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "dpserve_requests",
            "Requests answered by the router, by endpoint, replica and HTTP status.",
            ["endpoint", "replica", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "dpserve_request_duration_seconds",
            "Time from request to the last byte relayed, by endpoint and whether it streamed.",
            ["endpoint", "stream"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_byte = Histogram(
            "dpserve_time_to_first_byte_seconds",
            "Time from request to the replica's first response: its first event for streams (TTFT), "
            "its headers otherwise.",
            ["endpoint", "stream"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "dpserve_retries",
            "Requests sent again to another replica, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "dpserve_rejected_requests",
            "Requests refused by the router itself, by HTTP status.",
            ["status"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "dpserve_routing_decisions",
            "Routing decisions, by policy and chosen replica.",
            ["policy", "replica"],
            registry=self.registry,
        )
        self.client_disconnects = Counter(
            "dpserve_client_disconnects",
            "Requests whose client left before the answer was complete (the replica's request is aborted).",
            ["endpoint"],
            registry=self.registry,
        )
        self.broken_streams = Counter(
            "dpserve_broken_streams",
            "Streams cut by the replica after the first byte, ended with an SSE error event.",
            ["replica"],
            registry=self.registry,
        )
        self.policy_name = policy_name
        self.registry.register(_ReplicaStateCollector(replicas))


class _ReplicaStateCollector(Collector):
    """Replica state read at scrape time, so the hot path keeps no second copy of it."""

    def __init__(self, replicas: ReplicaRegistry) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "healthy": GaugeMetricFamily(
                "dpserve_replica_healthy", "1 when the replica passes its probes.", labels=["replica"]
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
        }
        for replica in self._replicas:
            gauges["healthy"].add_metric([replica.id], 1.0 if replica.healthy else 0.0)
            gauges["in_flight"].add_metric([replica.id], replica.in_flight)
            gauges["running"].add_metric([replica.id], replica.running)
            gauges["waiting"].add_metric([replica.id], replica.waiting)
            gauges["kv_usage"].add_metric([replica.id], replica.kv_usage)
        yield from gauges.values()
