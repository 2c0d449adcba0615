"""Admission control: how many requests each replica gets, and who waits in the router's queue for the
rest. Two bounds, either off: a fixed `--max-in-flight` per replica (the requests of this router and of
its peers, which tell theirs within `--peer-interval`), and,
with flow control, the capacity each replica showed in its own metrics (`replicas/capacity.py`), against
its whole load (peers' and other clients' requests included). Past them requests wait, released in fair
order (`flow/fair_queue.py`: priority classes, then tenants by tokens served), or, without flow control, in
arrival order. A full queue or a wait past the timeout is refused with 429 and `Retry-After`; with a
full queue a `batch` request is shed to make room for a more urgent one.

Room is a fact about the replica now, not a memory of this router's traffic: the first held request
looks again whenever a replica may have gained room (`notify`: an answer ended, a scrape, a peer's
requests ended, a replica added or back), and at least every `RECHECK_S` whatever told it. While any is
held, replicas full only because of load that is not the routers' are scraped every
`--held-probe-interval` (`replicas/monitor.py`), so load from elsewhere that ends is seen within that.

A slot that frees on a replica stays empty for the router's round trip (the answer's end reaching the
router, the next request reaching the engine) unless a request already waits in the engine. Where that
was seen to idle a noticeable share of a replica's slots (`capacity.py`: a CPU replica with short
answers; not a fast one, where it costs nothing), and while every request in the router's queue is one
tenant's, of one class, the first of them may go past the capacity by `engine_queue`, so the next slot
that frees there is filled at once. Another tenant's request, or a more urgent one, never goes past the
capacity: it takes the next free slot, behind at most that one.

Requests with an SLO (`policies/slo.py`) go before their tenant's best effort of their class; while they
come, best effort leaves them their share of each replica's slots (at most `--slo-reserve`); and the wait
one would have here is learned from the waits of those before it, so the router can refuse at once the
request whose wait would end past its SLO (`expected_wait_s`, `wait_chance`)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dpserve.policies.base import ReplicaView
from dpserve.policies.latency import MIN_SECONDS, OnlineFit
from dpserve.router.flow.fair_queue import FairQueue
from dpserve.router.http.errors import OpenAIError

STANDARD = 1
BATCH = 2
URGENT_MEMORY_S = 30.0
"""How long after a more urgent request batch requests still leave their reserve."""
RECHECK_S = 0.05
"""The floor under every wake-up: the first held request looks for room at least this often, whatever
did or did not tell it that room may have freed."""
WAIT_PRIOR = (0.1, 0.05)
"""Seconds a request with an SLO waits in the queue: until the first slot frees, and more per request
released before it. A guess for the first waits; each wait corrects it (`OnlineFit`)."""
WAIT_TYPICAL = (1.0, 4.0)
"""The inputs' usual sizes: the constant, and requests released before one."""
WAIT_RATIOS_KEPT = 256
"""Recent waits over their predictions kept, for the chance a predicted-late wait ends in time."""
SHARE_WEIGHT = 0.01
"""How far each request moves the share of requests with an SLO: about the last 100 count."""


class Rejected(OpenAIError):
    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(
            429,
            message,
            type="rate_limit_error",
            code=reason,
            headers={"retry-after": str(max(1, math.ceil(retry_after_s)))},
        )
        self.reason = reason


@dataclass(init=False)
class Ticket:
    """One request's place in the flow: whose it is, what it is expected to cost, how long it waited."""

    tenant: str
    weight: float
    cost: float
    """Tokens to charge the tenant when it is admitted (once, retries included)."""
    charged: float
    """What was charged: corrected by what the answer took (`Admission.settle`)."""
    queue_s: float

    def __init__(
        self, tenant: str = "", weight: float = 1.0, cost: float = 0.0, charged: float = 0.0, queue_s: float = 0.0
    ) -> None:
        # Written out: dataclass's __init__ is interpreted even when compiled (see policies.base.RequestFeatures).
        self.tenant = tenant
        self.weight = weight
        self.cost = cost
        self.charged = charged
        self.queue_s = queue_s


class _Waiter:
    __slots__ = ("model", "refused", "since", "wake")

    def __init__(self, loop: asyncio.AbstractEventLoop, since: float, model: str) -> None:
        self.wake: asyncio.Future[None] = loop.create_future()
        self.refused: Rejected | None = None
        self.since = since
        self.model = model


class Admission:
    def __init__(
        self,
        limit_per_replica: int,
        queue_size: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        flow_control: bool = False,
        batch_reserve: float = 0.1,
        engine_queue: int = 1,
        slo_reserve: float = 0.0,
    ) -> None:
        """`limit_per_replica` 0: no fixed limit. `flow_control`: hold requests past each replica's learned
        capacity and release them in fair order; `batch_reserve`: the share of a replica's slots `batch`
        requests leave to the others; `slo_reserve`: the most of a replica's slots best-effort requests leave
        to those with an SLO (their share of recent requests, up to this); `engine_queue`: requests per
        replica past its capacity that the one tenant filling the queue may keep waiting in the engine."""
        self.limit = limit_per_replica
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.flow_control = flow_control
        self.batch_reserve = batch_reserve
        self.slo_reserve = slo_reserve
        self._promised_until = -math.inf
        self._promised_share = 0.0
        """The share of recent requests with an SLO (a moving average over about the last 100)."""
        self.engine_queue = engine_queue
        self._spare = 0
        # `engine_queue` while the first waiter, alone in the queue with its own tenant's, looks for room.
        self.holds = limit_per_replica > 0 or flow_control
        """False: every request goes straight on, nothing ever waits."""
        self._clock = clock
        self._queue: FairQueue[_Waiter] = FairQueue()
        self._urgent_until = -math.inf
        self.timeouts = 0
        """Requests refused after waiting `timeout_s` (429 `queue_timeout`)."""
        self._promised_wait = OnlineFit(WAIT_PRIOR, WAIT_TYPICAL)
        """How long requests with an SLO wait here, by how many go before them (learned from each)."""
        self._wait_ratios: deque[float] = deque(maxlen=WAIT_RATIOS_KEPT)
        """Recent waits of requests with an SLO over their predictions."""

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def urgent_recently(self) -> bool:
        """Requests more urgent than `batch` came in the last `URGENT_MEMORY_S` (seen with flow control)."""
        return self._clock() <= self._urgent_until

    def oldest_wait_s(self) -> float:
        """How long the request held longest has waited so far (0 with none held)."""
        if not self._queue:
            return 0.0
        return self._clock() - min(waiter.since for waiter in self._queue)

    def held_by_model(self) -> dict[str, tuple[int, float]]:
        """Per model asked for: how many requests are held, and the longest any has waited so far."""
        now, held = self._clock(), dict[str, tuple[int, float]]()
        for waiter in self._queue:
            count, longest = held.get(waiter.model, (0, 0.0))
            held[waiter.model] = (count + 1, max(longest, now - waiter.since))
        return held

    def depth_by_priority(self) -> dict[str, int]:
        return dict(zip(("critical", "standard", "batch"), self._queue.depths(), strict=True))

    def expected_wait_s(self, priority: int) -> float:
        """How long a newcomer with an SLO, of this class, would wait in the queue (learned from the waits
        of those before it, by how many went before each)."""
        return self._promised_wait.predict((1.0, float(self._before(priority))))

    def wait_model(self) -> dict[str, float]:
        """For /status: the learned wait of a request with an SLO here, fixed and per request before it."""
        fixed, per_request = self._promised_wait.weights
        return {
            "fixed_s": round(fixed, 4),
            "per_request_s": round(per_request, 4),
            "waits": self._promised_wait.samples,
        }

    def _before(self, priority: int) -> int:
        return self._queue.promised_before(priority) if self.flow_control else len(self._queue)

    def open(
        self, candidates: Sequence[ReplicaView], priority: int = STANDARD, promised: bool = False
    ) -> list[ReplicaView]:
        """The candidates with room for one more request of this class (`promised`: with an SLO)."""
        if not self.holds:
            return list(candidates)
        reserving = self._reserving(promised)
        return [c for c in candidates if self._room(c, priority, reserving)]

    def has_room(self, replica: ReplicaView, priority: int = STANDARD, promised: bool = False) -> bool:
        """Room on `replica` for one more request of this class (`promised`: with an SLO)."""
        return self._room(replica, priority, self._reserving(promised))

    def arrived(self, promised: bool) -> None:
        """A request reaches admission (`promised`: with an SLO): the share of them with one is followed."""
        if not self.flow_control:
            return
        self._promised_share += SHARE_WEIGHT * ((1.0 if promised else 0.0) - self._promised_share)
        if promised:
            self._promised_until = self._clock() + URGENT_MEMORY_S

    def _reserving(self, promised: bool) -> bool:
        """Whether a request leaves the SLO reserve free: best effort, while requests with an SLO come."""
        until = self._promised_until
        return not promised and self.slo_reserve > 0 and until > -math.inf and self._clock() <= until

    def _room(self, replica: ReplicaView, priority: int, reserving: bool) -> bool:
        limit = self.limit
        # The routers' requests together: peers tell theirs within `--peer-interval`.
        if limit and replica.in_flight + replica.peer_in_flight >= limit:
            return False
        capacity = replica.capacity if self.flow_control else 0
        if not capacity:
            return True
        if priority >= BATCH and self._clock() <= self._urgent_until:
            # While more urgent requests come, batch leaves them a reserve of what the replica was seen to run
            # (never its last slot), so one arriving into a batch flood starts at once instead of waiting for
            # a batch answer to end.
            confirmed = replica.confirmed_capacity or capacity
            return replica.load < confirmed - min(confirmed - 1, math.ceil(confirmed * self.batch_reserve))
        if reserving:
            # Likewise best effort leaves requests with an SLO their share of the slots (at most
            # `slo_reserve`) while they come: one arriving in a burst beside best effort finds a slot instead
            # of waiting past its SLO for one to free.
            confirmed = replica.confirmed_capacity or capacity
            share = min(self.slo_reserve, self._promised_share)
            return replica.load < confirmed - min(confirmed - 1, math.ceil(confirmed * share))
        if self._spare and replica.slow_refill:
            capacity += self._spare
        return replica.load < capacity

    def admit_at_once(self, priority: int = STANDARD, tenant: str = "", weight: float = 1.0, cost: float = 0.0) -> bool:
        """For a request that found a replica with room: admitted now, without waiting, when no request is
        waiting before it (the common case, which `wait_for_room` also serves, here without a coroutine);
        False when some are, so it must queue behind them through `wait_for_room`."""
        if self._queue:
            return False
        if self.flow_control:
            if priority < BATCH:
                self._urgent_until = self._clock() + URGENT_MEMORY_S
            if cost:
                self._queue.charge(tenant, cost, weight)
        return True

    async def wait_for_room(
        self,
        has_room: Callable[[], bool],
        priority: int = STANDARD,
        tenant: str = "",
        weight: float = 1.0,
        cost: float = 0.0,
        within_s: float | None = None,
        promised: bool = False,
        model: str = "",
    ) -> float:
        """Returns once `has_room()` holds and no request that goes first is still waiting; the seconds
        waited. `cost`: the tokens the request is expected to take, charged to its tenant on admission
        (`settle` corrects it). `within_s`: the request's own deadline (its TTFT SLO), when sooner than the
        queue's timeout: refused then, not sent late. Raises `Rejected` when the queue is full, the wait
        outlasts the timeout or the deadline, or the request is shed for a more urgent one. `promised`:
        the request carries an SLO, released before its tenant's best effort of its class. `model`: the one it
        asks for, for the scale signal (`held_by_model`)."""
        queue = self._queue
        if not self.flow_control:
            priority, tenant, cost, promised = STANDARD, "", 0.0, False  # one class, one tenant: arrival order
        elif priority < BATCH:
            self._urgent_until = self._clock() + URGENT_MEMORY_S
        if (not queue or queue.goes_first(priority, tenant)) and has_room():
            if cost:
                queue.charge(tenant, cost, weight)
            return 0.0
        if len(queue) >= self.queue_size:
            victim = queue.newest_of_lowest_class(below=priority) if self.flow_control else None
            if victim is None:
                raise Rejected(
                    "queue_full",
                    "The router is at capacity and its queue is full; retry after a moment.",
                    self.timeout_s / 4,
                )
            queue.remove(victim)
            victim.refused = Rejected(
                "shed",
                "This batch request was shed to make room for more urgent ones; retry later.",
                self.timeout_s / 4,
            )
            if not victim.wake.done():
                victim.wake.set_result(None)
        started = self._clock()
        bounded = within_s is not None and within_s < self.timeout_s
        deadline = started + (within_s if bounded and within_s is not None else self.timeout_s)
        waiter = _Waiter(asyncio.get_running_loop(), started, model)
        before = float(self._before(priority)) if promised else -1.0
        queue.push(waiter, priority, tenant, promised)
        try:
            while True:
                if waiter.refused is not None:
                    raise waiter.refused
                remaining = deadline - self._clock()
                if remaining <= 0 and bounded:
                    self._waited(before, self._clock() - started)  # at least this long
                    raise Rejected(
                        "slo_unattainable",
                        f"No replica had room for this request within its SLO ({within_s:g} s) while it waited in "
                        "the router's queue; retry later.",
                        self.timeout_s / 4,
                    )
                if remaining <= 0:
                    self.timeouts += 1
                    raise Rejected(
                        "queue_timeout",
                        f"No replica had room for this request within {self.timeout_s:g} s; retry later.",
                        self.timeout_s / 4,
                    )
                # Only the one that goes first may take a slot.
                first = queue.peek() is waiter
                if first and self._room_for_first(has_room, priority, tenant):
                    if cost:
                        queue.charge(tenant, cost, weight)
                    waited = self._clock() - started
                    self._waited(before, waited)
                    return waited
                # The first looks again within RECHECK_S even unwoken: room can come from where nothing
                # tells (a replica's load from elsewhere, read by a scrape no listener heard).
                pause = min(remaining, RECHECK_S) if first else remaining
                try:
                    await asyncio.wait_for(asyncio.shield(waiter.wake), pause)
                except TimeoutError:
                    continue
                waiter.wake = asyncio.get_running_loop().create_future()
        finally:
            queue.remove(waiter)
            # The next in line may find room too (several slots freed at once, or this one gave up).
            self.notify()

    def wait_chance(self, expected_s: float, within_s: float) -> float:
        """The share of recent waits of requests with an SLO that, predicted `expected_s`, would have ended
        within `within_s` (none before any was seen: a chance is what the queue has shown)."""
        ratios = self._wait_ratios
        if not ratios:
            return 0.0
        return sum(1 for ratio in ratios if expected_s * ratio <= within_s) / len(ratios)

    def _waited(self, before: float, waited_s: float) -> None:
        """A request with an SLO (`before` >= 0: that many went before it) left the queue after `waited_s`."""
        if before >= 0:
            fit = self._promised_wait
            self._wait_ratios.append(waited_s / max(fit.predict((1.0, before)), MIN_SECONDS))
            fit.learn((1.0, before), waited_s)

    def _room_for_first(self, has_room: Callable[[], bool], priority: int, tenant: str) -> bool:
        """`has_room()` for the first waiter, counting the engine's queue when only its tenant waits."""
        if not (self.flow_control and self.engine_queue and self._queue.only(priority, tenant)):
            return has_room()
        self._spare = self.engine_queue
        try:
            return has_room()
        finally:
            self._spare = 0

    def settle(self, tenant: str, tokens: float, weight: float = 1.0) -> None:
        """Corrects the tokens charged to a tenant on admission by what its answer really took."""
        if self.flow_control and tokens:
            self._queue.charge(tenant, tokens, weight)

    def notify(self) -> None:
        """A slot may have freed: wake the request that goes first to look."""
        head = self._queue.peek()
        if head is not None and not head.wake.done():
            head.wake.set_result(None)
