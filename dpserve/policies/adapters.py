"""Where a LoRA adapter's request may go: pure functions of the replicas' adapter slots and load.

vLLM holds at most `--max-loras` adapters at once and loads more at run time. A request for an adapter
goes, in this order of preference, to
1. replicas that hold it, if one of them is within the balance guard (the prefix policies' own: the least
   loaded of the fleet times 1.5, plus 8, by default) and the adapter is not crowded on them: the policy
   chooses among those. Crowded:
   its own requests in flight there are at least 2 and at least its holders' even share of everything in
   flight (a hot adapter that alone keeps its replicas as busy as the fleet's average), and a less loaded
   replica could load it;
2. else the least loaded replica with a free adapter slot (it keeps ADAPTERS_PER_BATCH_SLOT per adapter
   its batches mix, or `--lora-slots`): it loads the adapter first; replicas whose batches already mix
   their `--max-loras` adapters come last;
3. else the least loaded replica whose least recently used adapter is idle: that one is unloaded first;
4. else the replicas that hold it, however loaded; else nowhere yet (the request waits for an adapter to
   go idle), or, where requests cannot wait, the least loaded replica over its bound.
Case 1 failing is how a hot adapter spreads: it crowds its replicas (or fills them past the guard), and
the next request loads it on another replica; from then on the policy balances it over both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dpserve.policies.balance import BalanceGuard
from dpserve.policies.base import ReplicaView

ADAPTERS_PER_BATCH_SLOT = 4
"""Adapters a replica keeps loaded per adapter its batches can mix (vLLM's `--max-loras`), by default.
vLLM limits only the adapters in one batch, and swaps the others in from its CPU cache or disk when their
requests come: unloading down to `--max-loras` made every less popular adapter's request wait for an
unload and a load (`dpserve bench lora`: 40 loads per 100 requests and twice the TTFT p99 of ignoring
adapters altogether); four per slot keeps a skewed set of adapters loaded with few loads."""


@dataclass(frozen=True, slots=True)
class AdapterSlots:
    """One replica's adapters as a decision sees them."""

    max_loras: int
    """How many adapters one of its batches mixes (vLLM's `--max-loras`); 0: LoRA is off there, or not
    known yet."""
    loaded: frozenset[str] = frozenset()
    """Loaded, or being loaded by the router."""
    busy: frozenset[str] = frozenset()
    """With requests in flight (the router's, or running or waiting on the replica); never unloaded."""
    last_used: Mapping[str, float] = field(default_factory=dict)
    """When each loaded adapter last had a request start or end (for least recently used)."""
    in_flight: Mapping[str, int] = field(default_factory=dict)
    """The router's requests in flight there, per adapter (how much of the replica an adapter keeps busy)."""
    capacity: int = 0
    """How many adapters it keeps loaded (`--lora-slots`); 0: ADAPTERS_PER_BATCH_SLOT per `max_loras`."""

    @property
    def limit(self) -> int:
        return self.capacity or ADAPTERS_PER_BATCH_SLOT * self.max_loras

    @property
    def free(self) -> bool:
        return len(self.loaded) < self.limit

    @property
    def batch_full(self) -> bool:
        """As many adapters in use as one batch mixes: another adapter's request waits in vLLM."""
        return len(self.busy) >= self.max_loras

    def idle_victim(self) -> str | None:
        """The least recently used loaded adapter with nothing in flight, if any."""
        idle = [name for name in self.loaded if name not in self.busy]
        if not idle:
            return None
        return min(idle, key=lambda name: (self.last_used.get(name, 0.0), name))


NO_SLOTS = AdapterSlots(max_loras=0)
DEFAULT_GUARD = BalanceGuard()


@dataclass(frozen=True, slots=True)
class Placement:
    candidates: tuple[ReplicaView, ...]
    """What the policy may choose from (empty: nowhere yet; the request waits)."""
    reason: str
    """loaded | holder_full | free_slot | evict | loaded_busy | full | over_bound | blind: for metrics."""

    @property
    def loads(self) -> bool:
        return self.reason in ("free_slot", "evict", "over_bound")


def place(
    adapter: str,
    candidates: Sequence[ReplicaView],
    slots: Mapping[str, AdapterSlots],
    can_wait: bool = True,
    affinity: bool = True,
    guard: BalanceGuard = DEFAULT_GUARD,
    fleet: Sequence[ReplicaView] = (),
) -> Placement:
    """Narrow `candidates` (replicas with room now, LoRA on) for a request of `adapter` (see the module's
    docstring). `fleet`: the replicas that could serve it, with room or not (default: the candidates):
    while a holder within the guard is only full for now, the request waits for it rather than load the
    adapter elsewhere. `affinity` False: every candidate, as a baseline that ignores where adapters are."""
    if not candidates:
        return Placement((), "full")
    if not affinity:
        return Placement(tuple(candidates), "blind")
    pool = fleet or candidates
    holding = [c for c in pool if adapter in slots.get(c.id, NO_SLOTS).loaded]
    held_by = {c.id for c in holding}
    open_ids = {c.id for c in candidates}
    if holding:
        limit = guard.limit(pool)
        within = [c for c in holding if c.load <= limit]
        if within and not _crowded(adapter, holding, candidates, slots):
            open_within = tuple(c for c in within if c.id in open_ids)
            if open_within:
                return Placement(open_within, "loaded")
            # Its holders are full for now. A rarely used adapter waits for them; one that already keeps
            # them busy is loaded where there is room (waiting would be the norm for it, not a moment).
            if can_wait and _demand(adapter, holding, slots) < SPREAD_MIN_REQUESTS:
                return Placement((), "holder_full")
    others = [c for c in candidates if c.id not in held_by]
    target = _least_loaded([c for c in others if slots.get(c.id, NO_SLOTS).free], slots)
    if target is not None:
        return Placement((target,), "free_slot")
    target = _least_loaded([c for c in others if slots.get(c.id, NO_SLOTS).idle_victim() is not None], slots)
    if target is not None:
        return Placement((target,), "evict")
    open_holders = tuple(c for c in holding if c.id in open_ids)
    if open_holders:
        return Placement(open_holders, "loaded_busy")
    if can_wait:
        return Placement((), "full")
    target = _least_loaded([c for c in candidates if slots.get(c.id, NO_SLOTS).max_loras > 0], slots)
    return Placement((target,) if target is not None else (), "over_bound")


SPREAD_MIN_REQUESTS = 2
"""An adapter with fewer requests in flight than this never takes a second replica's slot for itself."""


def _demand(adapter: str, holding: Sequence[ReplicaView], slots: Mapping[str, AdapterSlots]) -> int:
    """The router's requests of the adapter in flight on its holders."""
    return sum(slots.get(c.id, NO_SLOTS).in_flight.get(adapter, 0) for c in holding)


def _crowded(
    adapter: str, holding: Sequence[ReplicaView], candidates: Sequence[ReplicaView], slots: Mapping[str, AdapterSlots]
) -> bool:
    """Whether the adapter alone keeps its holders at least as busy as an even share of the fleet's load,
    while a candidate that does not hold it, less loaded than every holder, has room for it."""
    demand = _demand(adapter, holding, slots)
    if demand < SPREAD_MIN_REQUESTS:
        return False
    held_by = {c.id for c in holding}
    everyone = list(holding) + [c for c in candidates if c.id not in held_by]
    even_share = sum(c.load for c in everyone) * len(holding) / len(everyone)
    if demand < even_share:
        return False
    least_held = min(c.load for c in holding)
    return any(
        c.load < least_held and (slot.free or slot.idle_victim() is not None)
        for c in candidates
        if c.id not in held_by
        for slot in (slots.get(c.id, NO_SLOTS),)
    )


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What a chosen replica must do before it can serve the adapter."""

    load: bool
    evict: str | None = None


def plan_load(adapter: str, slots: AdapterSlots) -> LoadPlan:
    """Nothing if it holds the adapter; else load it, unloading the least recently used idle adapter
    first when it holds its limit (none idle: load over the limit, vLLM swaps adapters itself)."""
    if adapter in slots.loaded:
        return LoadPlan(load=False)
    if slots.free or slots.max_loras <= 0:
        return LoadPlan(load=True)
    return LoadPlan(load=True, evict=slots.idle_victim())


def _least_loaded(candidates: Sequence[ReplicaView], slots: Mapping[str, AdapterSlots]) -> ReplicaView | None:
    # Where a batch can take one more adapter first (elsewhere the request would wait in vLLM's queue);
    # ties go to the replica holding fewer adapters (a burst of new adapters spreads over the fleet
    # before loads count as in flight), then the emptier KV cache, then the lower id (deterministic).
    def key(c: ReplicaView) -> tuple[bool, int, int, float, str]:
        slot = slots.get(c.id, NO_SLOTS)
        return slot.batch_full, c.load, len(slot.loaded), c.kv_usage, c.id

    return min(candidates, key=key, default=None)
