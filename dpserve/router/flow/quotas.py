"""Per-tenant quotas over a sliding one-minute window: requests per minute, tokens per minute and requests
in flight, so one tenant cannot take the whole fleet from the others.

The window is a ring of time buckets (`window_s / buckets` long each), expired lazily when a tenant is
touched, so there is no timer and an idle tenant costs nothing. Tokens are counted when an answer's usage
arrives (`finish`), so a long answer counts against the minute it ended in, and requests in flight are not
yet in the token count: the token quota holds up to what is in flight at once.

Across routers, each router reports its own usage to its peers (`take_news`) and counts what they report
(`add_remote`) in its own window, in the bucket of the moment it hears it. Quotas across routers are
therefore exact up to the peers' reporting lag plus the requests in flight on other routers.

Pure: no I/O, no asyncio; the clock is injected."""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

CONCURRENT_RETRY_S = 1.0
"""Retry-After for a tenant at its in-flight limit: a guess, since a slot frees when some answer ends."""


@dataclass(frozen=True, slots=True)
class Quota:
    """One tenant's limits; 0 (or less) means no limit on that count."""

    requests_per_min: int = 0
    tokens_per_min: int = 0
    """Prompt + completion tokens, counted when the answer's usage arrives."""
    concurrent: int = 0
    """Requests in flight at once."""
    limited: bool = field(init=False, compare=False, repr=False)
    """Whether any limit is set (an unlimited tenant need not be checked at all); read twice per request,
    so worked out once."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "limited", self.requests_per_min > 0 or self.tokens_per_min > 0 or self.concurrent > 0)


@dataclass(frozen=True, slots=True)
class OverQuota:
    """Why a request would be refused now, and when it would pass again."""

    limit: str
    """"requests_per_min", "tokens_per_min" or "concurrent"."""
    retry_after_s: float
    """Seconds until the request would pass (for "concurrent" a short guess); within [0, window_s]."""
    message: str
    """An OpenAI-style message for the client, naming the tenant, the limit and its value."""


class _Tenant:
    """One tenant's window: (bucket number, requests, tokens) for buckets with activity, oldest first."""

    __slots__ = ("buckets", "in_flight", "requests", "tokens")

    def __init__(self) -> None:
        self.buckets: deque[list[int]] = deque()
        self.requests = 0
        self.tokens = 0
        self.in_flight = 0

    def expire(self, oldest: int) -> None:
        """Drop the buckets older than bucket number `oldest`."""
        while self.buckets and self.buckets[0][0] < oldest:
            _, requests, tokens = self.buckets.popleft()
            self.requests -= requests
            self.tokens -= tokens

    def add(self, bucket: int, requests: int, tokens: int) -> None:
        # A clock that never runs back puts `bucket` at or after the newest; a later bucket opens a new entry.
        if self.buckets and self.buckets[-1][0] >= bucket:
            entry = self.buckets[-1]
            entry[1] += requests
            entry[2] += tokens
        else:
            self.buckets.append([bucket, requests, tokens])
        self.requests += requests
        self.tokens += tokens

    @property
    def idle(self) -> bool:
        """Nothing in the window and nothing in flight: forgetting it changes no answer."""
        return not self.buckets and self.in_flight == 0


class QuotaBook:
    """Every tenant's usage in the sliding window and in flight, checked against its `Quota`.

    Memory is bounded: at most `max_tenants` tenants are tracked (past that the least recently used one with
    nothing in flight is forgotten, which can only under-count it), plus tenants with requests in flight,
    which are never forgotten so that `finish` always finds them. Idle tenants are dropped as they age."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = 60.0,
        buckets: int = 60,
        max_tenants: int = 10_000,
    ) -> None:
        if window_s <= 0 or buckets < 1 or max_tenants < 1:
            raise ValueError("window_s must be > 0, buckets and max_tenants >= 1")
        self._clock = clock
        self.window_s = window_s
        self.buckets = buckets
        self.bucket_s = window_s / buckets
        self.max_tenants = max_tenants
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()
        self._news: dict[str, list[int]] = {}
        self.evicted = 0
        """Tenants forgotten to keep within `max_tenants` while they still had usage in the window."""
        self.news_dropped = 0
        """Reports for peers dropped because `take_news` was not called while `max_tenants` tenants had news."""

    @property
    def tenants(self) -> int:
        """Tenants tracked now."""
        return len(self._tenants)

    def check(self, tenant: str, quota: Quota) -> OverQuota | None:
        """Whether one more request for `tenant` would pass now; None if it would. Of several limits hit, the
        one with the longest wait is named, so that a client retrying after it is not refused at once again."""
        if not quota.limited:
            return None
        state = self._current(tenant)
        if state is None:
            return None  # nothing counted: no positive limit can be reached
        over: list[OverQuota] = []
        if quota.requests_per_min > 0 and state.requests + 1 > quota.requests_per_min:
            wait = self._wait(state, 1, state.requests + 1 - quota.requests_per_min)
            over.append(self._over(tenant, "requests_per_min", quota.requests_per_min, "requests per minute", wait))
        if quota.tokens_per_min > 0 and state.tokens >= quota.tokens_per_min:
            wait = self._wait(state, 2, state.tokens - quota.tokens_per_min + 1)
            over.append(self._over(tenant, "tokens_per_min", quota.tokens_per_min, "tokens per minute", wait))
        if quota.concurrent > 0 and state.in_flight >= quota.concurrent:
            over.append(self._over(tenant, "concurrent", quota.concurrent, "requests in flight", CONCURRENT_RETRY_S))
        if not over:
            return None
        return max(over, key=lambda o: o.retry_after_s)  # max keeps the first of equals

    def start(self, tenant: str) -> None:
        """A request was admitted: it counts in the window's requests and in flight until `finish`."""
        state = self._touch(tenant)
        state.add(self._bucket(), 1, 0)
        state.in_flight += 1
        self._report(tenant, 1, 0)

    def finish(self, tenant: str, tokens: int) -> None:
        """A request's answer ended (`tokens` prompt + completion; 0 for a failure)."""
        tokens = max(0, tokens)
        if not tokens and tenant not in self._tenants:
            return  # forgotten while idle (it had nothing in flight), and nothing to add
        state = self._touch(tenant)
        state.in_flight = max(0, state.in_flight - 1)
        if tokens:
            state.add(self._bucket(), 0, tokens)
            self._report(tenant, 0, tokens)
        elif state.idle:
            self._tenants.pop(tenant, None)

    def add_remote(self, origin: str, tenant: str, requests: int, tokens: int) -> None:
        """Usage a peer router (`origin`) reported for `tenant`, counted in this router's window from now on.
        It is not passed on in `take_news` (each router reports only its own). `origin` is not kept."""
        requests, tokens = max(0, requests), max(0, tokens)
        if requests or tokens:
            self._touch(tenant).add(self._bucket(), requests, tokens)

    def take_news(self) -> dict[str, tuple[int, int]]:
        """This router's own (requests, tokens) per tenant since the last call: what goes to the peers."""
        news, self._news = self._news, {}
        return {tenant: (counts[0], counts[1]) for tenant, counts in news.items()}

    def in_flight(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.in_flight if state is not None else 0

    def used(self, tenant: str) -> tuple[int, int]:
        """(requests, tokens) in the current window, this router's and its peers'."""
        state = self._current(tenant)
        return (state.requests, state.tokens) if state is not None else (0, 0)

    def _bucket(self) -> int:
        # The nudge keeps a time computed as a bucket boundary (a Retry-After) from rounding down a bucket.
        return math.floor(self._clock() / self.bucket_s + 1e-9)

    def _current(self, tenant: str) -> _Tenant | None:
        """The tenant's state with old buckets expired, or None when nothing of it is counted."""
        state = self._tenants.get(tenant)
        if state is None:
            return None
        state.expire(self._bucket() - self.buckets + 1)
        if state.idle:
            del self._tenants[tenant]
            return None
        return state

    def _touch(self, tenant: str) -> _Tenant:
        """The tenant's state (made if new), expired and marked most recently used; keeps the bound."""
        state = self._tenants.get(tenant)
        if state is None:
            self._make_room()
            state = self._tenants[tenant] = _Tenant()
        else:
            self._tenants.move_to_end(tenant)
        state.expire(self._bucket() - self.buckets + 1)
        return state

    def _make_room(self) -> None:
        """Forget idle tenants at the old end, and the least recently used ones past `max_tenants`."""
        oldest = self._bucket() - self.buckets + 1
        for _ in range(2):  # a little at a time, so idle tenants leave without a sweep
            if not self._tenants:
                break
            name, state = next(iter(self._tenants.items()))
            state.expire(oldest)
            if not state.idle:
                break
            del self._tenants[name]
        busy = 0
        while len(self._tenants) >= self.max_tenants and busy < len(self._tenants):
            name, state = next(iter(self._tenants.items()))
            if state.in_flight:
                self._tenants.move_to_end(name)  # in use, so recently used; never forgotten
                busy += 1
                continue
            state.expire(oldest)
            if not state.idle:
                self.evicted += 1
            del self._tenants[name]

    def _report(self, tenant: str, requests: int, tokens: int) -> None:
        counts = self._news.get(tenant)
        if counts is None:
            if len(self._news) >= self.max_tenants:
                self.news_dropped += 1
                return
            counts = self._news[tenant] = [0, 0]
        counts[0] += requests
        counts[1] += tokens

    def _wait(self, state: _Tenant, field: int, need: int) -> float:
        """Seconds until the oldest buckets holding `need` of `field` (1 requests, 2 tokens) leave the window:
        a bucket leaves at its end plus the window, so the answer falls on a bucket boundary."""
        now = self._clock()
        dropped = 0
        for entry in state.buckets:
            dropped += entry[field]
            if dropped >= need:
                leaves_at = (entry[0] + self.buckets) * self.bucket_s
                return min(self.window_s, max(self.bucket_s, leaves_at - now))
        return self.window_s

    @staticmethod
    def _over(tenant: str, limit: str, value: int, what: str, wait: float) -> OverQuota:
        message = (
            f"Rate limit reached for tenant '{tenant}' on {limit}: limit {value} {what}. "
            f"Please try again in {max(1, math.ceil(wait))} s."
        )
        return OverQuota(limit=limit, retry_after_s=wait, message=message)
