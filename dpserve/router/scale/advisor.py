"""Each router's scale advisor: looks at every model's replicas once a second (and at once when the fleet
changes or a request waits for a replica), runs the signal (`signal.py`), and keeps what it said: the
desired count and its inputs per model (`/admin/scale`, the dpserve_desired_replicas and dpserve_scale_*
series, `/status`), the reason for the last change, and a replica's measured start-up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.flow.admission import Admission
from dpserve.router.quality.latency_watch import SloBook
from dpserve.router.scale.held import Held
from dpserve.router.scale.signal import ScaleInputs, ScaleRules, ScaleState, decide, first_state

log = logging.getLogger("dpserve.router")

INTERVAL_S = 1.0
STARTUPS_KEPT = 5
"""The start-up said is the median of the last few measured."""
HISTORY_KEPT = 50


class ColdWaiters:
    """Requests for a model no replica serves (`cold_start.py`), by model: those waiting for a replica to
    start, and those refused at once (the start-up would outlast their wait), counted until their Retry-After
    so that the replica their retry needs is started all the same."""

    def __init__(self) -> None:
        self._arrived: dict[str, list[float]] = {}
        self._refused: dict[str, list[float]] = {}
        """Model -> until when each refused request counts."""

    def add(self, model: str, at: float) -> None:
        self._arrived.setdefault(model, []).append(at)

    def remove(self, model: str, at: float) -> None:
        arrived = self._arrived.get(model)
        if arrived is not None:
            arrived.remove(at)
            if not arrived:
                del self._arrived[model]

    def refused(self, model: str, until: float) -> None:
        self._refused.setdefault(model, []).append(until)

    def _refused_now(self, model: str, now: float) -> int:
        untils = self._refused.get(model)
        if not untils:
            return 0
        untils[:] = [until for until in untils if until > now]
        if not untils:
            del self._refused[model]
        return len(untils)

    def models(self) -> list[str]:
        return list(dict.fromkeys([*self._arrived, *self._refused]))

    def count(self, model: str, now: float) -> int:
        return len(self._arrived.get(model, ())) + self._refused_now(model, now)

    def oldest_wait_s(self, model: str, now: float) -> float:
        arrived = self._arrived.get(model)
        return now - min(arrived) if arrived else 0.0

    @property
    def total(self) -> int:
        return sum(len(arrived) for arrived in self._arrived.values())


class ScaleAdvisor:
    def __init__(
        self,
        registry: ReplicaRegistry,
        catalog: ModelCatalog,
        admission: Admission,
        rules: ScaleRules,
        slo: SloBook | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self._registry, self._catalog, self._admission, self._slo = registry, catalog, admission, slo
        self.rules = rules
        self._clock = clock
        self._interval_s = interval_s
        self.cold = ColdWaiters()
        self._peers_held: dict[str, dict[str, Held]] = {}
        """Peer origin -> what it holds per model (`peer_held`)."""
        self._held_listeners: list[Callable[[], None]] = []
        self.states: dict[str, ScaleState] = {}
        self.inputs: dict[str, ScaleInputs] = {}
        self.version = 0
        """Goes up with every change of a desired count (`/admin/scale?after=` waits for it)."""
        self.changes: Counter[tuple[str, str]] = Counter()
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_KEPT)
        self.startups: deque[float] = deque(maxlen=STARTUPS_KEPT)
        self._raised_at: float | None = None
        """When the signal last asked for more replicas than serve, not yet answered by one more serving."""
        self._seen: set[str] = set()
        """Every replica of the last look: one found serving and not among them is new."""
        self._not_serving: set[str] = set()
        """Those of the last look that had never served (starting)."""
        self._poked: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        registry.on_reshape(self.poke)

    @property
    def startup_s(self) -> float | None:
        """A replica's start-up as measured here (median of the last few); None: not measured yet."""
        return statistics.median(self.startups) if self.startups else None

    def eta_s(self) -> float | None:
        """How long until the next replica asked for serves, as measured; None: not known."""
        startup = self.startup_s
        if startup is None:
            return None
        if self._raised_at is None:
            return startup
        return max(0.0, startup - (self._clock() - self._raised_at))

    def desired(self) -> int:
        """The most any model needs (a fleet of one model: its count)."""
        return max((state.desired for state in self.states.values()), default=0)

    def start(self) -> None:
        self._poked, self._changed = asyncio.Event(), asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="scale-advisor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def poke(self) -> None:
        """Look again now: the fleet changed, or a request waits for a replica."""
        if self._poked is not None:
            self._poked.set()

    def on_held_change(self, listener: Callable[[], None]) -> None:
        """`listener` hears when requests start or stop waiting for a replica (peers hear of them at once)."""
        self._held_listeners.append(listener)

    def held_changed(self) -> None:
        """A request began or stopped waiting for a replica to start: look again, and tell the listeners."""
        self.poke()
        for listener in self._held_listeners:
            listener()

    async def wait_change(self, after: int, timeout_s: float) -> None:
        """Returns once `version` is past `after`, or after `timeout_s`."""
        deadline = self._clock() + timeout_s
        while self.version <= after and self._changed is not None:
            left = deadline - self._clock()
            if left <= 0:
                return
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def _run(self) -> None:
        assert self._poked is not None
        while True:
            try:
                self.tick()
            except Exception:  # a bug here must not stop the signal for good
                log.exception("scale advisor: a look at the fleet failed")
            self._poked.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poked.wait(), self._interval_s)

    def tick(self) -> None:
        now = self._clock()
        self._measure_startup(now)  # first: a replica that just came up tells how long one takes
        for model in self._models():
            inputs = self.inputs[model] = self.read(model, now)
            state = self.states.get(model) or first_state(inputs, now)
            new = self.states[model] = decide(inputs, state, self.rules, now)
            if new.desired != state.desired:
                self._changed_to(model, state.desired, new, now)

    def _models(self) -> list[str]:
        """Models any replica reported, those requests wait for, and those the signal still holds above 0."""
        catalog = self._catalog
        known = catalog.known_base_models()
        asked = [*self.cold.models(), *(model for held in self._peers_held.values() for model in held)]
        kept = [name for name, state in self.states.items() if state.desired > 0 or name in known]
        for gone in [name for name in self.states if name not in kept and name not in asked]:
            del self.states[gone]  # a name only a bad request ever asked for
            self.inputs.pop(gone, None)
        return list(dict.fromkeys([*known, *asked, *kept]))

    def read(self, model: str, now: float) -> ScaleInputs:
        ready = starting = draining = load = engine_waiting = 0
        capacities: list[int] = []
        kv: list[float] = []
        for replica in self._registry:
            if not replica.health.ever_healthy and not replica.draining and replica.misconfigured is None:
                starting += 1  # its models are not read yet: it counts for each
                continue
            if model not in replica.models:
                continue
            if replica.draining:
                draining += 1
                load += replica.load
            elif replica.routable:
                ready += 1
                load += replica.load
                engine_waiting += replica.waiting
                kv.append(replica.kv_usage)
                if replica.slots:
                    capacities.append(replica.slots)
        held, since = self._held(model, ready > 0)
        attainment = self._slo.attainment(model) if self._slo is not None else None
        return ScaleInputs(
            ready=ready,
            starting=starting,
            draining=draining,
            load=load,
            queued=held,
            queue_wait_s=max(0.0, now - since) if held else 0.0,
            capacity=round(statistics.fmean(capacities)) if capacities else 0,
            engine_waiting=engine_waiting,
            kv_usage=statistics.fmean(kv) if kv else 0.0,
            slo_attainment=attainment,
            startup_s=self.startup_s,
        )

    def own_held(self) -> dict[str, Held]:
        """Model -> the requests this router holds for it: in its queue for room (an adapter's for its base
        model), and waiting for a replica to start while none serves the model. Its peers add it to theirs."""
        now, catalog, held = self._clock(), self._catalog, dict[str, Held]()
        for asked, (count, waited) in self._admission.held_by_model().items():
            model = (catalog.adapter_parent(asked) or asked) if catalog.is_adapter(asked) else asked
            was = held.get(model, Held())
            since = min(was.queued_since, now - waited) if was.queued else now - waited
            held[model] = was._replace(queued=was.queued + count, queued_since=since)
        for model in self.cold.models():
            if not catalog.serves(model) and (count := self.cold.count(model, now)):
                since = now - self.cold.oldest_wait_s(model, now)
                held[model] = held.get(model, Held())._replace(cold=count, cold_since=since)
        return held

    def peer_held(self, origin: str, held: dict[str, Held]) -> None:
        """What a peer router (or a sibling worker) holds now; each router's share of the queue asks for
        replicas in every router, as the replicas' load does (`peers/board.py`)."""
        if self._peers_held.get(origin, {}) == held:
            return
        if held:
            self._peers_held[origin] = held
        else:
            self._peers_held.pop(origin, None)
        self.poke()

    def _held(self, model: str, ready: bool) -> tuple[int, float]:
        """Requests held for the model in this router and its peers, and when the oldest began waiting. Those
        waiting for a replica to start count while none is ready here: once one is, they are on their way
        to it (a peer may not have seen it serve yet)."""
        count, since = 0, math.inf
        for held in (self.own_held().get(model), *(peer.get(model) for peer in self._peers_held.values())):
            if held is None:
                continue
            if held.queued:
                count, since = count + held.queued, min(since, held.queued_since)
            if held.cold and not ready:
                count, since = count + held.cold, min(since, held.cold_since)
        return count, since

    def _changed_to(self, model: str, was: int, state: ScaleState, now: float) -> None:
        direction = "up" if state.desired > was else "down"
        self.changes[(model, direction)] += 1
        self.version += 1
        self.history.append(
            {"at": time.time(), "model": model, "from": was, "to": state.desired, "reason": state.reason}
        )
        log.info("desired replicas of %s: %d -> %d (%s)", model, was, state.desired, state.reason)
        if direction == "up" and self._raised_at is None:
            self._raised_at = now
        if self._changed is not None:
            self._changed.set()

    def _measure_startup(self, now: float) -> None:
        """From the signal asking for more replicas than serve to one more serving: a start-up as those who
        act on the signal deliver it (their reaction, the process's start, its first probe). Only a replica
        new to routing counts (one seen starting, or found serving at once, as DNS finds a ready pod): a
        drained one resumed is no start-up."""
        serving, fresh, waiting = 0, False, set()
        for replica in self._registry:
            if replica.routable:
                serving += 1
                fresh = fresh or replica.id in self._not_serving or replica.id not in self._seen
            elif not replica.health.ever_healthy:
                waiting.add(replica.id)
        self._seen = {replica.id for replica in self._registry}
        self._not_serving = waiting
        # Raised on this very look (`_changed_to`): nothing serving now was started for it.
        if self._raised_at is not None and self._raised_at < now and fresh:
            self.startups.append(now - self._raised_at)
            log.info("a replica serves %.1f s after the signal asked for it", now - self._raised_at)
            self._raised_at = now if self.desired() > serving else None
        elif self.desired() <= serving:
            self._raised_at = None

    def status(self) -> dict[str, Any]:
        """`/admin/scale` and /status's `scale`."""
        now, wall = self._clock(), time.time()
        models = []
        for model, state in self.states.items():
            inputs = self.inputs.get(model)
            models.append(
                {
                    "model": model,
                    "desired": state.desired,
                    "reason": state.reason,
                    "changed_at": round(wall - (now - state.changed_at), 3),
                    "scale_down_pending_s": round(now - state.low_since, 1) if state.low_since is not None else None,
                    "inputs": asdict(inputs) if inputs is not None else None,
                }
            )
        startup = self.startup_s
        return {
            "version": self.version,
            "desired": self.desired(),
            "models": models,
            "startup_seconds": round(startup, 2) if startup is not None else None,
            "startup_samples": [round(sample, 2) for sample in self.startups],
            "waiting_for_replica": self.cold.total,
            "rules": asdict(self.rules),
            "history": list(self.history),
        }


class ScaleCollector(Collector):
    """dpserve_desired_replicas and its inputs (dpserve_scale_*), per model, read at scrape time."""

    def __init__(self, advisor: ScaleAdvisor) -> None:
        self._advisor = advisor

    def collect(self) -> Iterator[Metric]:
        advisor = self._advisor
        desired = GaugeMetricFamily(
            "dpserve_desired_replicas",
            "Replicas the model's load needs, as this router sees it (with hysteresis and cool-down): what "
            "dpserve up, KEDA or an HPA scale to.",
            labels=["model"],
        )
        replicas = GaugeMetricFamily(
            "dpserve_scale_replicas",
            "The model's replicas by state: ready, starting, draining.",
            labels=["model", "state"],
        )
        gauges = {
            "queued": GaugeMetricFamily(
                "dpserve_scale_queue_depth",
                "Requests for the model waiting in this router and its peers (for room, or for a replica to start).",
                labels=["model"],
            ),
            "queue_wait_s": GaugeMetricFamily(
                "dpserve_scale_queue_wait_seconds", "The oldest of them has waited this long.", labels=["model"]
            ),
            "load": GaugeMetricFamily(
                "dpserve_scale_load_requests",
                "Requests running or waiting on the model's replicas (every client's).",
                labels=["model"],
            ),
            "capacity": GaugeMetricFamily(
                "dpserve_scale_capacity_requests",
                "Requests one replica runs at once, as measured, else as told (--replica-max-num-seqs); 0: not known.",
                labels=["model"],
            ),
            "kv_usage": GaugeMetricFamily(
                "dpserve_scale_kv_usage_ratio", "Mean KV-cache usage of its ready replicas.", labels=["model"]
            ),
            "slo_attainment": GaugeMetricFamily(
                "dpserve_scale_slo_attainment_ratio",
                "Share of its requests with an SLO that met it over the last minute.",
                labels=["model"],
            ),
        }
        for model, state in advisor.states.items():
            desired.add_metric([model], state.desired)
            inputs = advisor.inputs.get(model)
            if inputs is None:
                continue
            for name in ("ready", "starting", "draining"):
                replicas.add_metric([model, name], getattr(inputs, name))
            for field, gauge in gauges.items():
                value = getattr(inputs, field)
                if value is not None:
                    gauge.add_metric([model], float(value))
        yield desired
        yield replicas
        yield from gauges.values()
        startup = GaugeMetricFamily(
            "dpserve_scale_startup_seconds",
            "A replica's measured start-up: the signal asking for it to its serving (median of the last 5).",
            labels=["model"],
        )
        if advisor.startup_s is not None:
            for model in advisor.states:
                startup.add_metric([model], advisor.startup_s)
        yield startup
        changes = CounterMetricFamily(
            "dpserve_scale_changes",
            "Changes of the desired count, by model and direction.",
            labels=["model", "direction"],
        )
        for (model, direction), count in sorted(advisor.changes.items()):
            changes.add_metric([model, direction], count)
        yield changes
