"""The desired-replicas signal: how many replicas a model's load needs, a pure function of what the router
sees (its replicas' load and measured capacity, its queue, KV-cache pressure, SLO attainment) and of the
signal's own last state, so it is tested without sockets.

Up at once: the load and its random spread (`spread` standard deviations) over `target` of the replicas'
measured capacity (projected one start-up ahead while it rises), or pressure the capacity does not show
(requests waiting long in the router or in the replicas' queues, KV caches nearly full, SLOs missed,
requests waiting with no replica at all). Down only when every look of the delay (never less than twice a
measured start-up: a replica let go must not be needed back before it could start) needed fewer at a lower
utilization (`target` less `HYSTERESIS`) and none is starting; then to the most any look of the last delay
needed, a window that rolls on (Kubernetes' HPA stabilization). No bounds: whoever acts on it (`dpserve up`,
KEDA) clamps it to its own minimum and maximum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

HYSTERESIS = 0.2
"""Scale-down aims at `target` less this share of it: a load just under the target does not flap."""
TREND_WINDOW_S = 10.0
"""The load's rise is measured over at least this long."""
SMOOTHING_S = 5.0


@dataclass(frozen=True, slots=True)
class ScaleRules:
    target: float = 0.8
    """Share of the replicas' measured capacity the load is aimed at."""
    spread: float = 1.0
    """Headroom over the load, in its standard deviations: requests arriving at random put a load of L at about
    L +- sqrt(L), so replicas that each run a few requests at once queue in every burst at a fixed utilization
    (4 slots a replica at 80%: the elastic day's ramp queued, docs/benchmarks/elastic.md), where large ones
    barely notice (sqrt(200) is 7% of 200)."""
    down_delay_s: float = 30.0
    queue_wait_s: float = 1.0
    """A request waiting this long in the router's queue asks for one more replica."""
    kv_pressure: float = 0.9
    """Mean KV-cache usage at which one more replica is asked for."""
    slo_floor: float = 0.9
    """SLO attainment below which one more replica is asked for."""


@dataclass(frozen=True, slots=True)
class ScaleInputs:
    """What the router sees of one model's replicas at one moment."""

    ready: int = 0
    """Routable replicas serving it."""
    starting: int = 0
    """Replicas added and not yet serving (counted for every model: their models are not known yet)."""
    draining: int = 0
    load: int = 0
    """Requests running or waiting on its routable and draining replicas, the routers' and others'."""
    queued: int = 0
    """Requests for the model (or an adapter on it) waiting in the router: for room, or for a replica to start."""
    queue_wait_s: float = 0.0
    """The oldest of them, seconds."""
    capacity: int = 0
    """Requests one of its replicas runs at once, as measured or seen once while requests waited, else as told
    (mean of those known); 0: not known yet."""
    engine_waiting: int = 0
    """Requests waiting in its replicas' own queues, as their metrics showed (before any capacity is known,
    the one sign that they are full)."""
    kv_usage: float = 0.0
    """Mean KV-cache usage of its routable replicas."""
    slo_attainment: float | None = None
    """Share of its requests with an SLO that met it over the last minute; None: none had one."""
    startup_s: float | None = None
    """A replica's measured start-up (the signal rising to the replica serving); None: not measured yet."""

    @property
    def current(self) -> int:
        return self.ready + self.starting

    @property
    def demand(self) -> int:
        return self.load + self.queued


@dataclass(frozen=True, slots=True)
class ScaleState:
    desired: int
    reason: str
    changed_at: float
    low_since: float | None = None
    """Since when every look needed fewer than `desired` (None: the last did not)."""
    lows: tuple[tuple[float, int], ...] = ()
    """(at, replicas needed) of the looks of the last delay, each needing more than every later one: the first
    is the most any look of the delay needed, what a scale-down goes to."""
    level: float = 0.0
    """The demand smoothed over about `SMOOTHING_S`: one look's jitter is no trend."""
    level_at: float = 0.0
    trend_at: float = 0.0
    trend_level: float = 0.0
    """`level` at `trend_at`, at most twice `TREND_WINDOW_S` ago: the rise is measured against it."""


def first_state(inputs: ScaleInputs, now: float) -> ScaleState:
    """Before the first decision: what runs now is what is desired."""
    demand = float(inputs.demand)
    return ScaleState(inputs.current, "started", now, level=demand, level_at=now, trend_at=now, trend_level=demand)


def rising(state: ScaleState, demand: int, now: float) -> tuple[float, float, float, float]:
    """The smoothed demand, the baseline it is compared with (at, level) and its rise a second (0 when it
    falls), measured over `TREND_WINDOW_S` at least, so a burst between two close looks is no slope."""
    weight = 1.0 - math.exp(-(now - state.level_at) / SMOOTHING_S) if now > state.level_at else 0.0
    level = state.level + weight * (demand - state.level)
    trend_at, trend_level = state.trend_at, state.trend_level
    rise = max(0.0, (level - trend_level) / max(now - trend_at, TREND_WINDOW_S))
    if now - trend_at >= 2 * TREND_WINDOW_S:  # a fresh baseline; the slope from it counts over the window
        trend_at, trend_level = now, level
    return level, trend_at, trend_level, rise


def replicas_for(demand: float, capacity: int, target: float) -> int:
    """Replicas of `capacity` requests each that hold `demand` at `target` utilization."""
    return math.ceil(demand / (capacity * target) - 1e-9) if demand > 0 else 0


def pressure(inputs: ScaleInputs, rules: ScaleRules) -> str | None:
    """Why the load needs one more replica than runs, whatever the capacity says; None: no such reason."""
    if inputs.queued and inputs.current == 0:
        return f"{inputs.queued} request(s) waiting and no replica"
    if inputs.queued and inputs.queue_wait_s >= rules.queue_wait_s:
        return f"{inputs.queued} request(s) queued in the router, the oldest {inputs.queue_wait_s:.1f} s"
    if inputs.engine_waiting and not inputs.capacity:
        return f"{inputs.engine_waiting} request(s) waiting in the replicas' own queues"
    if inputs.ready and inputs.kv_usage >= rules.kv_pressure:
        return f"KV caches {inputs.kv_usage:.0%} full"
    if inputs.slo_attainment is not None and inputs.slo_attainment < rules.slo_floor:
        return f"SLO attainment {inputs.slo_attainment:.0%} under {rules.slo_floor:.0%}"
    return None


def decide(inputs: ScaleInputs, state: ScaleState, rules: ScaleRules, now: float) -> ScaleState:
    """The signal after one look at `inputs`; `changed_at == now` when `desired` moved."""
    demand = inputs.demand
    level, trend_at, trend_level, rise = rising(state, demand, now)
    # What it will be once a replica asked for now serves; at most as much again as now.
    ahead = min(rise * (inputs.startup_s or 0.0), float(demand))
    capacity = inputs.capacity
    why = pressure(inputs, rules)
    calm = demand == 0 and level < 0.5  # the smoothed level only tends to 0
    if capacity:
        # The load now over the target (a surge), or its smoothed level and spread (the bursts to come); each
        # look's own load and its spread counted a burst twice: at night a load of 2 asked for a second replica.
        typical = 0.0 if calm else level + ahead + rules.spread * math.sqrt(level + ahead)
        need = max(replicas_for(demand + ahead, capacity, rules.target), replicas_for(typical, capacity, rules.target))
        said = f"load {demand}" + (f" rising to ~{demand + ahead:.0f}" if ahead >= 1 else "")
        reason = f"{said} over {capacity} a replica at {rules.target:.0%}"
        # Never below what this look needs: that went down and up again in one second.
        low = max(need, replicas_for(typical, capacity, rules.target * (1 - HYSTERESIS)))
    else:  # not measured yet: only pressure adds one, only no load at all lets them go
        need, reason = inputs.current, f"load {demand}, capacity not measured yet"
        low = 0 if calm else inputs.current
    if why is not None:  # one more, unless one is already on its way
        need, reason, low = max(need, inputs.current + (0 if inputs.starting else 1)), why, state.desired
    if demand > 0:
        need, low = max(need, 1), max(low, 1)
    delay = max(rules.down_delay_s, 2 * (inputs.startup_s or 0.0))
    if inputs.starting:  # a start under way is let finish, then the whole delay runs
        low = max(low, state.desired)
    lows = remembered(state.lows, now, low, delay)
    looked = replace(state, lows=lows, level=level, level_at=now, trend_at=trend_at, trend_level=trend_level)
    if need > state.desired:
        return replace(looked, desired=need, reason=reason, changed_at=now, low_since=None)
    if low >= state.desired:
        return replace(looked, low_since=None)
    low_since = state.low_since if state.low_since is not None else now
    if now - low_since < delay:
        return replace(looked, low_since=low_since)
    # To the most any look of the delay needed, as Kubernetes' HPA stabilizes a scale-down; the window rolls on,
    # so a load that keeps falling is followed a delay behind, not a delay per step.
    since, to = lows[0]
    held = f"for {delay:.0f} s" if delay else "now"
    return replace(looked, desired=to, reason=f"{reason}: {to} enough {held}", changed_at=now, low_since=since)


def remembered(
    lows: tuple[tuple[float, int], ...], now: float, needed: int, delay: float
) -> tuple[tuple[float, int], ...]:
    """The looks of the last `delay` that needed more than every later one, this one (`needed`) last."""
    return (*((at, n) for at, n in lows if at > now - delay and n > needed), (now, needed))
