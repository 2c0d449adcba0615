"""Counters and histograms kept as plain numbers, turned into Prometheus families only when scraped.

prometheus_client's `inc` and `observe` take a lock and walk its value objects on every call: the router's
per-request series (answers, their timing, the routing decisions) cost about 45k instructions a request
that way, a twelfth of a tiny JSON answer's. The router's requests are counted on one event loop, so a
dict of numbers does; a scrape (in another thread) reads a copy, made under the GIL in one C call. The
exposition is prometheus_client's own (`CounterMetricFamily`, `HistogramMetricFamily`), the same names,
help and buckets as a `Counter` or `Histogram` would have printed (tests/unit/test_tallies.py compares).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

Labels = tuple[str, ...]


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
        for key, value in list(self.values.items()):
            family.add_metric(list(key), value)
        return family


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
        for key, series in list(self.series.items()):
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
