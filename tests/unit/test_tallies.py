"""Tallies and spreads export what prometheus_client's own Counter and Histogram export for the same counts:
the same lines, names, labels, `le` values, sums and help."""

from __future__ import annotations

import random
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from dpserve.router.observe.metrics import LATENCY_BUCKETS, Spread, Tally, TallyCollector


def exposition(registry: CollectorRegistry) -> list[str]:
    """The lines, less `*_created` (the router turns those off process-wide, `serve.py`)."""
    return sorted(line for line in generate_latest(registry).decode().splitlines() if "_created" not in line)


def libraries_and_ours(labels: list[str], buckets: tuple[float, ...]) -> tuple[CollectorRegistry, ...]:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter("x_requests", "Requests.", labels, registry=theirs)
    histogram = Histogram("x_seconds", "Seconds.", labels, buckets=buckets, registry=theirs)
    tally, spread = Tally("x_requests", "Requests.", labels), Spread("x_seconds", "Seconds.", labels, buckets)
    ours.register(TallyCollector((tally, spread)))
    pick = random.Random(7)
    values = [*buckets, 0.0, 1e-9, 1e9, *(pick.uniform(0, 400) for _ in range(500))]
    for value in values:
        key = tuple(pick.choice(("a", "b", 'q"x')) for _ in labels)
        (counter.labels(*key) if labels else counter).inc(value)
        (histogram.labels(*key) if labels else histogram).observe(value)
        tally.add(key, value)
        spread.observe(key, value)
    return theirs, ours


def test_labelled_families_print_as_the_librarys_own() -> None:
    theirs, ours = libraries_and_ours(["endpoint", "stream"], LATENCY_BUCKETS)
    assert exposition(ours) == exposition(theirs)


def test_families_without_labels_print_as_the_librarys_own_before_and_after_counting() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    Counter("x_requests", "Requests.", registry=theirs)
    Histogram("x_seconds", "Seconds.", buckets=(0, 1, 2.5), registry=theirs)
    ours.register(TallyCollector((Tally("x_requests", "Requests."), Spread("x_seconds", "Seconds.", (), (0, 1, 2.5)))))
    assert exposition(ours) == exposition(theirs)  # the one series at 0 from the start
    theirs, ours = libraries_and_ours([], (0, 1, 2.5))
    assert exposition(ours) == exposition(theirs)


def test_a_value_on_a_bound_counts_in_that_bucket() -> None:
    spread = Spread("x_seconds", "Seconds.", (), (1, 2))
    for value in (1.0, 2.0, 2.0000001):
        spread.observe((), value)
    (sample_family,) = [spread.family()]
    buckets = {s.labels["le"]: s.value for s in sample_family.samples if s.name == "x_seconds_bucket"}
    assert buckets == {"1.0": 1, "2.0": 2, "+Inf": 3}
    assert spread.count() == 3


def test_a_scrape_in_another_thread_while_series_are_added_reads_a_consistent_copy() -> None:
    """The event loop adds series while a scrape thread iterates: the copy is taken in one call, so a scrape
    never meets a dict that changed size under it (iterating the dict itself fails here at once; a copy taken
    once failed in one run of the whole suite, hence `_copy`'s retry)."""
    tally, spread = Tally("x_requests", "Requests.", ["k"]), Spread("x_seconds", "Seconds.", ["k"], (1,))
    registry = CollectorRegistry()
    registry.register(TallyCollector((tally, spread)))
    scrapes: list[int] = []
    failures: list[BaseException] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            try:
                generate_latest(registry)
            except BaseException as exc:  # any failure is the test's finding
                failures.append(exc)
                return
            scrapes.append(1)

    def add(keys: range) -> None:
        for key in keys:
            tally.add((str(key),))
            spread.observe((str(key),), 0.5)

    add(range(5_000))  # each scrape then takes long enough for series to be added during it
    scraper = threading.Thread(target=scrape)
    scraper.start()
    add(range(5_000, 60_000))
    done.set()
    scraper.join()
    assert not failures and scrapes
    assert tally.value(("0",)) == 1.0 and spread.count(("59999",)) == 1 and len(tally.values) == 60_000
