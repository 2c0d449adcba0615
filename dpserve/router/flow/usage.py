"""Per-tenant usage accounting: requests, errors, tokens and queueing time, in total and per minute for the
last hour, for `GET /admin/usage` (billing, who is using the fleet) and for Prometheus.

Memory is bounded: at most `max_tenants` tenants are kept by name (allow-listed names always are); past
that, usage of new names is recorded under "other". Tenants are never forgotten, so totals only grow and
the exported counters stay monotonic. Metrics labels are bounded too: only the allow-listed (`named`)
tenants get their own label, every other tenant is summed into tenant="other".

Pure: no I/O, no asyncio; the clock is injected."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

OTHER = "other"
"""The name that tenants past the bound are recorded under, and the metrics label of non-named tenants."""


@dataclass
class UsageCounts:
    requests: int = 0
    errors: int = 0
    """Answers with status >= 400 (the router's refusals included) and broken streams."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float = 0.0
    """Seconds spent waiting in the router's queue, summed."""

    def add(self, other: UsageCounts) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        self.queue_s += other.queue_s

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


class _TenantUsage:
    __slots__ = ("closed", "minutes")

    def __init__(self) -> None:
        self.closed = UsageCounts()
        """Every minute before the newest one, summed (expired minutes included): a request adds to its
        minute only, and a minute's counts join these when the next one opens."""
        self.minutes: deque[tuple[int, UsageCounts]] = deque()
        """(minute start in epoch seconds, that minute's counts), oldest first, only minutes with activity."""

    @property
    def total(self) -> UsageCounts:
        total = UsageCounts()
        total.add(self.closed)
        if self.minutes:
            total.add(self.minutes[-1][1])
        return total


class UsageBook:
    """Every tenant's usage since the router started, and per minute over the last `minutes` minutes."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        named: Collection[str] = (),
        max_tenants: int = 1000,
        minutes: int = 60,
    ) -> None:
        """`clock`: epoch seconds (the per-minute keys are wall-clock minutes). `named`: the tenants that get
        their own metrics label. `max_tenants`: names kept besides the named ones and "other"."""
        if max_tenants < 0 or minutes < 1:
            raise ValueError("max_tenants must be >= 0 and minutes >= 1")
        self._clock = clock
        self.named = frozenset(named)
        self.max_tenants = max_tenants
        self.minutes = minutes
        self.since = clock()
        self._tenants: dict[str, _TenantUsage] = {}
        self._unnamed = 0  # tenants kept by name that are not in `named` (nor "other")

    def record(
        self,
        tenant: str,
        error: bool,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        completion_tokens: int = 0,
        queue_s: float = 0.0,
    ) -> None:
        """One answered request (or refusal, or broken stream: `error`). Runs once per request: the counts
        are added in place to the current minute (negative inputs count as 0)."""
        usage = self._tenants.get(tenant) or self._tenant(tenant)
        minute = int(self._clock() // 60) * 60
        minutes = usage.minutes
        # A wall clock that stepped back adds to the newest minute rather than reordering the ring.
        if minutes and minutes[-1][0] >= minute:
            current = minutes[-1][1]
        else:
            self._expire(usage, minute)
            if minutes:  # the newest minute closes (unless it just expired, and was closed then)
                usage.closed.add(minutes[-1][1])
            current = UsageCounts()
            minutes.append((minute, current))
        current.requests += 1
        if error:
            current.errors += 1
        if prompt_tokens > 0:
            current.prompt_tokens += prompt_tokens
        if cached_tokens > 0:
            current.cached_tokens += cached_tokens
        if completion_tokens > 0:
            current.completion_tokens += completion_tokens
        if queue_s > 0:
            current.queue_s += queue_s

    def label(self, tenant: str) -> str:
        """The tenant's metrics label: its name if allow-listed, else "other"."""
        return tenant if tenant in self.named else OTHER

    def totals_by_label(self) -> dict[str, UsageCounts]:
        """Totals summed per metrics label; every named tenant and "other" are present, zero if unseen."""
        by_label = {name: UsageCounts() for name in (*sorted(self.named), OTHER)}
        for name, usage in list(self._tenants.items()):
            by_label[self.label(name)].add(usage.total)
        return by_label

    def to_dict(self) -> dict[str, Any]:
        """For GET /admin/usage."""
        minute = int(self._clock() // 60) * 60
        tenants: dict[str, Any] = {}
        for name in sorted(self._tenants):
            usage = self._tenants[name]
            self._expire(usage, minute)
            tenants[name] = {
                "total": usage.total.to_dict(),
                "per_minute": [{"minute": start, **counts.to_dict()} for start, counts in usage.minutes],
            }
        return {"since": self.since, "minutes": self.minutes, "tenants": tenants}

    def _tenant(self, tenant: str) -> _TenantUsage:
        usage = self._tenants.get(tenant)
        if usage is not None:
            return usage
        if tenant not in self.named and tenant != OTHER:
            if self._unnamed >= self.max_tenants:
                return self._tenant(OTHER)
            self._unnamed += 1
        usage = self._tenants[tenant] = _TenantUsage()
        return usage

    def _expire(self, usage: _TenantUsage, minute: int) -> None:
        """Drop minutes older than the last `minutes` (the current one included)."""
        oldest = minute - (self.minutes - 1) * 60
        minutes = usage.minutes
        while minutes and minutes[0][0] < oldest:
            _, counts = minutes.popleft()
            if not minutes:  # the newest minute, not yet in `closed`
                usage.closed.add(counts)


class UsageCollector(Collector):
    """dpserve_tenant_* series, read from a `UsageBook` at scrape time, labelled by `UsageBook.label`."""

    def __init__(self, book: UsageBook) -> None:
        self._book = book

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "dpserve_tenant_requests", "Requests answered, by tenant (not allow-listed: other).", labels=["tenant"]
        )
        errors = CounterMetricFamily(
            "dpserve_tenant_errors",
            "Answers with status >= 400 (router refusals included) and broken streams, by tenant.",
            labels=["tenant"],
        )
        tokens = CounterMetricFamily(
            "dpserve_tenant_tokens",
            "Tokens by tenant and kind (prompt, cached, completion).",
            labels=["tenant", "kind"],
        )
        queue = CounterMetricFamily(
            "dpserve_tenant_queue_seconds",
            "Seconds requests waited in the router's queue, by tenant.",
            labels=["tenant"],
        )
        for label, counts in self._book.totals_by_label().items():
            requests.add_metric([label], counts.requests)
            errors.add_metric([label], counts.errors)
            tokens.add_metric([label, "prompt"], counts.prompt_tokens)
            tokens.add_metric([label, "cached"], counts.cached_tokens)
            tokens.add_metric([label, "completion"], counts.completion_tokens)
            queue.add_metric([label], counts.queue_s)
        yield from (requests, errors, tokens, queue)
