"""The order in which held requests are released: strict priority between classes, and within a class a
weighted fair share between tenants by tokens served (a virtual token counter, after Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024), first come first served within a tenant, those
promised a time (an SLO) before its best effort.

Each tenant's counter grows by the tokens it is served (prompt + completion) divided by its weight; the
waiting tenant with the lowest counter goes next. A tenant that starts waiting again after a pause has
its counter raised to the lowest of those already waiting (or to where service stood), so an idle
tenant cannot bank credit and then crowd out the others. No I/O, no asyncio: the admission queue
(`flow/admission.py`) keeps the waiters, this keeps their order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class FairQueue(Generic[T]):
    def __init__(self, classes: int = 3, max_idle_tenants: int = 10_000) -> None:
        """`classes`: priority classes, 0 the most urgent. Counters of tenants with nothing waiting are
        kept for at most `max_idle_tenants` (past that the ones at or below the service floor go: for
        them forgetting and raising on return are the same)."""
        self._classes: list[dict[str, deque[T]]] = [{} for _ in range(classes)]
        self._where: dict[T, tuple[int, str]] = {}
        self._promised: set[T] = set()
        self._counters: dict[str, float] = {}
        self._waiting_per_tenant: dict[str, int] = {}
        self._floor = 0.0
        """The highest counter an admitted tenant had: where service stands."""
        self._max_idle = max_idle_tenants

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: T) -> bool:
        return item in self._where

    def __iter__(self) -> Iterator[T]:
        """Everyone waiting, in no particular order."""
        return iter(self._where)

    def depths(self) -> list[int]:
        """Waiters per class, most urgent first."""
        return [sum(len(backlog) for backlog in backlogs.values()) for backlogs in self._classes]

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, self._floor)

    def push(self, item: T, priority: int, tenant: str, promised: bool = False) -> None:
        """`promised`: the request carries an SLO; it goes before its tenant's best effort of its class."""
        priority = min(max(priority, 0), len(self._classes) - 1)
        if not self._waiting_per_tenant.get(tenant):
            self._counters[tenant] = max(self._counters.get(tenant, 0.0), self._reference())
            self._trim()
        backlog = self._classes[priority].get(tenant)
        if backlog is None:
            backlog = self._classes[priority][tenant] = deque()
        if promised:
            self._promised.add(item)
            # After the promised ones already waiting, before the first that was not.
            at = next((i for i, waiting in enumerate(backlog) if waiting not in self._promised), len(backlog))
            backlog.insert(at, item)
        else:
            backlog.append(item)
        self._where[item] = (priority, tenant)
        self._waiting_per_tenant[tenant] = self._waiting_per_tenant.get(tenant, 0) + 1

    def remove(self, item: T) -> None:
        """Out of the queue, served or not (a no-op when it is not in it)."""
        place = self._where.pop(item, None)
        if place is None:
            return
        self._promised.discard(item)
        priority, tenant = place
        backlogs = self._classes[priority]
        backlog = backlogs[tenant]
        backlog.remove(item)
        if not backlog:
            del backlogs[tenant]
        left = self._waiting_per_tenant[tenant] - 1
        if left:
            self._waiting_per_tenant[tenant] = left
        else:
            del self._waiting_per_tenant[tenant]

    def peek(self) -> T | None:
        """The next to release: the most urgent class with a waiter, its tenant with the lowest counter
        (ties: the shorter backlog, then the longest waiting head), that tenant's oldest request."""
        for backlogs in self._classes:
            if backlogs:
                # A tenant that joins is raised to the lowest waiting counter, so it often ties with a heavy
                # tenant's backlog: the light one goes first. Then the tenant that began waiting first: dicts
                # keep insertion order and min() keeps the first of equals.
                tenant = min(backlogs, key=lambda name: (self.counter(name), len(backlogs[name])))
                return backlogs[tenant][0]
        return None

    def promised_before(self, priority: int) -> int:
        """Waiting requests that a promised newcomer of this class would go after: every one of a more
        urgent class, and the promised ones of its own (across tenants: a bound, not the fair order)."""
        priority = min(max(priority, 0), len(self._classes) - 1)
        ahead = sum(self.depths()[:priority])
        return ahead + sum(1 for item in self._promised if self._where[item][0] == priority)

    def goes_first(self, priority: int, tenant: str) -> bool:
        """Would a newcomer of this class and tenant be released before everything now waiting?"""
        priority = min(max(priority, 0), len(self._classes) - 1)
        for index, backlogs in enumerate(self._classes):
            if index == priority:
                if tenant in backlogs:
                    return False  # behind its own tenant's earlier requests
                mine = max(self.counter(tenant), self._reference()) if tenant not in self._waiting_per_tenant else 0
                # As `peek` would order it once pushed: by counter, then backlog (its own would be 1).
                return all((mine, 1) < (self.counter(other), len(backlogs[other])) for other in backlogs)
            if backlogs:
                return False
        return True

    def only(self, priority: int, tenant: str) -> bool:
        """Whether everything waiting is this tenant's, of this class."""
        priority = min(max(priority, 0), len(self._classes) - 1)
        waiting = self._waiting_per_tenant
        if len(waiting) != 1 or tenant not in waiting:
            return False
        backlog = self._classes[priority].get(tenant)
        return backlog is not None and len(backlog) == waiting[tenant]

    def newest_of_lowest_class(self, below: int) -> T | None:
        """The most recent waiter of the least urgent class less urgent than `below`: the one to shed."""
        for index in range(len(self._classes) - 1, below, -1):
            backlogs = self._classes[index]
            if backlogs:
                # The tenant with the highest counter has had most; its newest request goes.
                tenant = max(backlogs, key=self.counter)
                return backlogs[tenant][-1]
        return None

    def charge(self, tenant: str, tokens: float, weight: float = 1.0) -> None:
        """Service given to `tenant` (tokens; negative to correct an estimate). A positive charge is an
        admission: the service floor moves up to where that tenant stood."""
        before = self._counters.get(tenant, self._floor)
        self._counters[tenant] = before + tokens / weight
        if tokens > 0:
            self._floor = max(self._floor, before)

    def _reference(self) -> float:
        """Where a tenant that starts waiting joins: the lowest waiting counter, or the service floor."""
        lowest: float | None = None
        for tenant in self._waiting_per_tenant:
            value = self._counters.get(tenant, self._floor)
            if lowest is None or value < lowest:
                lowest = value
        return self._floor if lowest is None else lowest

    def _trim(self) -> None:
        if len(self._counters) <= self._max_idle + len(self._waiting_per_tenant):
            return
        floor = self._floor
        for tenant in [t for t, v in self._counters.items() if v <= floor and t not in self._waiting_per_tenant]:
            del self._counters[tenant]
        if len(self._counters) > self._max_idle + len(self._waiting_per_tenant):
            # Still too many: the idle ones nearest the floor go first (they lose the least by being raised).
            idle = sorted((v, t) for t, v in self._counters.items() if t not in self._waiting_per_tenant)
            for _, tenant in idle[: len(self._counters) - self._max_idle - len(self._waiting_per_tenant)]:
                del self._counters[tenant]
