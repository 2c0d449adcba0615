"""One scrape answers for every worker: counts and each worker's own load added up, what each sees of
the same shared thing taken once (no sockets: the exposition texts two workers would give)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dpserve.router.observe.worker_metrics import merge


def worker(requests: int, in_flight: int, healthy: int, ejections: int, started: float, waits: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("dpserve_requests", "r", ["endpoint", "replica"], registry=registry)
    counter.labels("chat", "r0").inc(requests)
    Gauge("dpserve_replica_in_flight_requests", "f", ["replica"], registry=registry).labels("r0").set(in_flight)
    Gauge("dpserve_replica_healthy", "h", ["replica"], registry=registry).labels("r0").set(healthy)
    Counter("dpserve_replica_ejections", "e", ["replica"], registry=registry).labels("r0").inc(ejections)
    Gauge("process_start_time_seconds", "s", registry=registry).set(started)
    wait = Histogram("dpserve_queue_wait_seconds", "w", buckets=(0.1, 1.0), registry=registry)
    for value in waits:
        wait.observe(value)
    return generate_latest(registry).decode()


def values(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def test_counts_and_own_load_add_up_and_shared_views_are_taken_once() -> None:
    merged = values(merge([worker(38, 2, 1, 1, 100.0, [0.0, 0.5]), worker(62, 3, 1, 1, 90.0, [2.0])]))
    r0 = (("replica", "r0"),)
    assert merged[("dpserve_requests_total", (("endpoint", "chat"), ("replica", "r0")))] == 100
    assert merged[("dpserve_replica_in_flight_requests", r0)] == 5
    assert merged[("dpserve_replica_healthy", r0)] == 1  # both see the one replica healthy: not 2
    assert merged[("dpserve_replica_ejections_total", r0)] == 1  # each saw the same ejection
    assert merged[("process_start_time_seconds", ())] == 90.0
    assert merged[("dpserve_queue_wait_seconds_count", ())] == 3
    assert merged[("dpserve_queue_wait_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged[("dpserve_queue_wait_seconds_bucket", (("le", "1.0"),))] == 2


def test_one_worker_alone_is_its_own_series() -> None:
    text = worker(7, 1, 1, 0, 5.0, [0.2])
    assert values(merge([text])) == values(text.encode())
