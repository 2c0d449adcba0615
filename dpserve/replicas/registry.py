"""The router's view of its replicas: identity, health, served models, load."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpserve.gpu.placement import parse_replica_spec
from dpserve.policies.adapters import AdapterSlots
from dpserve.policies.base import LoadFromCounts, ReplicaView
from dpserve.replicas.adapter_folder import AdapterFolder
from dpserve.replicas.adapters import ReplicaAdapters, adapter_cards
from dpserve.replicas.capacity import Capacity, learn
from dpserve.replicas.health import SOFT_FAILURES, HealthRules, HealthState, HealthTracker, Outcome

log = logging.getLogger("dpserve.registry")


@dataclass
class Replica(LoadFromCounts):
    id: str
    url: str
    model_cards: tuple[dict[str, Any], ...] = ()
    """The replica's own /v1/models entries, kept so the router can list them while it is down."""
    models: tuple[str, ...] = ()
    """The cards' ids: what routing checks on every request. Set both through `set_model_cards`."""
    block_size: int | None = None
    kv_blocks: int = 0
    """Its KV cache in blocks (`num_gpu_blocks`), 0 until read."""
    health: HealthState = field(default_factory=HealthState)
    draining: bool = False
    """Taken out of routing by the admin API: requests in flight finish, no new ones come."""
    in_flight: int = 0
    peer_in_flight: int = 0
    running: int = 0
    waiting: int = 0
    in_flight_at_scrape: int = 0
    kv_usage: float = 0.0
    learned: Capacity = field(default_factory=Capacity)
    """How many requests it runs at once, as its metrics showed (`replicas/capacity.py`)."""
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    last_error: str | None = None
    last_scrape: float | None = None
    served_total: int = 0
    gpu_hint: tuple[str, ...] = ()
    """GPU indices or UUIDs from `--replica URL@gpu=N` (the launcher gives them for replicas it starts)."""
    degraded: tuple[str, ...] = ()
    """Why its GPU is unfit (throttling, Xid errors, ...): soft-drained, still routable when no other
    replica has room. Empty: fit, or not known."""
    lora: ReplicaAdapters = field(default_factory=ReplicaAdapters)
    """Its LoRA adapters: slots, loaded, in use (`replicas/adapters.py`)."""

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def capacity(self) -> int:
        """Requests it runs at once (perhaps one more being tried); 0 while not known."""
        return self.learned.limit

    @property
    def slow_refill(self) -> bool:
        """Its slots were seen idle while requests were on their way to it (`capacity.py`)."""
        return self.learned.slow_refill

    @property
    def confirmed_capacity(self) -> int:
        """Requests it was last seen to run when full; 0 while not known."""
        return self.learned.confirmed

    @property
    def routable(self) -> bool:
        return self.health.healthy and not self.draining

    @property
    def state(self) -> str:
        if self.draining:
            return "draining"
        if self.health.healthy:
            return "degraded" if self.degraded else "healthy"
        return "ejected" if self.health.ever_healthy else "starting"

    def set_model_cards(self, cards: tuple[dict[str, Any], ...]) -> None:
        """Call through `ReplicaRegistry.set_model_cards`, which keeps routing's cached view current."""
        self.model_cards = cards
        self.models = tuple(str(card["id"]) for card in cards)
        self.lora.listed(adapter_cards(cards))


def adapter_card(name: str, path: str, parent: str | None, parent_card: dict[str, Any] | None) -> dict[str, Any]:
    """An adapter's /v1/models card as vLLM writes one, for an adapter no replica has loaded yet."""
    created = parent_card.get("created") if parent_card else None
    return {
        "id": name,
        "object": "model",
        "created": created if isinstance(created, int) else int(time.time()),
        "owned_by": "vllm",
        "root": path,
        "parent": parent,
        "max_model_len": None,
        "permission": parent_card.get("permission", []) if parent_card else [],
    }


def replica_id(index: int) -> str:
    """The id of the `index`-th replica the router was given or had added: the launcher, compose and
    the router all name replicas through this."""
    return f"r{index}"


def replica_ids(count: int) -> list[str]:
    """Ids in the order replicas were given: the launcher and the router agree on them."""
    return [replica_id(index) for index in range(count)]


class ReplicaRegistry:
    """Replicas by id. Ids are `r0, r1, ...` in the order replicas were given, then added at run time;
    a removed replica's id is never reused, so metrics and logs stay unambiguous."""

    def __init__(
        self,
        specs: Sequence[str],
        rules: HealthRules | None = None,
        clock: Callable[[], float] = time.monotonic,
        adapters: Mapping[str, str] | None = None,
        adapter_folder: AdapterFolder | None = None,
        assumed_max_loras: int = 0,
        adapter_slots: int = 0,
    ) -> None:
        """`specs`: replica URLs, each optionally followed by `@gpu=N` (see `parse_replica_spec`); none
        where replicas are all discovered or added later. `adapters`: LoRA adapters by name, with their
        paths as the replicas see them (`--lora`, `--lora-dir`); replicas' own adapters are learned from
        their /v1/models. `assumed_max_loras`: a replica's adapter slots until it reports its own."""
        self._adapter_folder = adapter_folder
        self.adapter_paths: dict[str, str] = adapter_folder.read() if adapter_folder is not None else {}
        """Every adapter's path: configured, or learned from a replica's card (its `root`)."""
        self.adapter_paths.update(adapters or {})
        self._configured_adapters = set(self.adapter_paths)
        """Served whether or not a replica has them now; a learned one only while a replica lists it (an
        adapter someone unloads everywhere is gone, not loaded back by the router)."""
        self._adapter_names: frozenset[str] | None = None
        """The adapters served now: configured, or listed by a replica (`is_adapter`; cached until
        `_reshaped`)."""
        self._adapter_parents: dict[str, str] = {}
        self._assumed_max_loras = assumed_max_loras
        self.adapter_slots = adapter_slots
        """Adapters each replica keeps loaded (`--lora-slots`); 0: the default per its `max_loras`."""
        self._replicas: dict[str, Replica] = {}
        self._next_id = 0
        self._tracker = HealthTracker(rules or HealthRules())
        self._clock = clock
        self._listeners: list[Callable[[], None]] = []
        self._refused_listeners: list[Callable[[str], None]] = []
        # Routable replicas per model, rebuilt only when routability or models change (`_reshaped`),
        # so the hot path never scans the whole fleet to find its candidates.
        self._views: dict[str, tuple[Replica, ...]] = {}
        self._view_ids: dict[str, tuple[str, ...]] = {}
        self._served: list[str] | None = None
        self.degraded_ids: frozenset[str] = frozenset()
        """Replicas whose GPU is unfit (`set_degraded`): read on every decision, so kept as a set."""
        for spec in specs:
            self.add(spec)

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def __contains__(self, replica_id: str) -> bool:
        return replica_id in self._replicas

    def get(self, replica_id: str) -> Replica:
        return self._replicas[replica_id]

    def find(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def by_url(self, url: str) -> Replica | None:
        url = url.rstrip("/")
        return next((r for r in self._replicas.values() if r.url == url), None)

    def add(self, spec: str) -> Replica:
        url, hint = parse_replica_spec(spec)
        if self.by_url(url) is not None:
            raise ValueError(f"{url} is already a replica")
        replica = Replica(id=replica_id(self._next_id), url=url, gpu_hint=hint)
        replica.lora.max_loras = self._assumed_max_loras  # until its metrics say
        self._next_id += 1
        self._replicas[replica.id] = replica
        self._reshaped()
        self._changed()
        return replica

    def remove(self, replica_id: str) -> Replica:
        """Out of the registry at once; requests in flight on it finish (their release is a no-op)."""
        replica = self._replicas.pop(replica_id)
        self.degraded_ids = self.degraded_ids - {replica_id}
        self._reshaped()
        return replica

    def set_draining(self, replica_id: str, draining: bool) -> None:
        self._replicas[replica_id].draining = draining
        self._reshaped()
        self._changed()

    def set_degraded(self, replica_id: str, reasons: tuple[str, ...]) -> bool:
        """Mark (reasons) or clear (empty) a replica's GPU trouble; True when that changed whether it is
        degraded. Clearing it may give waiting requests room, so listeners hear of it."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return False
        was = bool(replica.degraded)
        replica.degraded = reasons
        if bool(reasons) == was:
            return False
        if reasons:
            self.degraded_ids = self.degraded_ids | {replica_id}
            log.warning("replica %s degraded: %s; new requests go elsewhere", replica_id, "; ".join(reasons))
        else:
            self.degraded_ids = self.degraded_ids - {replica_id}
            log.info("replica %s no longer degraded: its GPU is fit again", replica_id)
            self._changed()
        return True

    def on_change(self, listener: Callable[[], None]) -> None:
        """`listener` runs whenever a replica may have gained room: a slot freed (this router's, a peer's),
        a replica added or admitted, a scrape (load from elsewhere may have ended)."""
        self._listeners.append(listener)

    def on_refused(self, listener: Callable[[str], None]) -> None:
        """`listener(replica_id)` runs when nothing accepted a connection to a replica: it may be gone."""
        self._refused_listeners.append(listener)

    def _tell_refused(self, replica_id: str) -> None:
        for listener in self._refused_listeners:
            listener(replica_id)

    def healthy(self) -> list[Replica]:
        """Replicas routing may use: healthy and not draining."""
        return [r for r in self._replicas.values() if r.routable]

    def served_models(self) -> list[str]:
        """Models of routable replicas, de-duplicated, in replica order."""
        return list(self._served_models())

    def serves(self, model: str) -> bool:
        """Whether a routable replica serves `model` (cheap: read on every request)."""
        return bool(self.routable(model))

    def only_model(self) -> str | None:
        """The one base model routable replicas serve, when there is exactly one (adapters aside)."""
        served = [name for name in self._served_models() if not self.is_adapter(name)]
        return served[0] if len(served) == 1 else None

    def _served_models(self) -> list[str]:
        # Cached until routability or models change (`_reshaped`): read on every request.
        if self._served is None:
            self._served = list(self.model_cards(healthy_only=True))
        return self._served

    def routable(self, model: str) -> tuple[Replica, ...]:
        """Replicas routing may use for `model`, in id order (cached until routability changes)."""
        view = self._views.get(model)
        if view is None:
            if self.is_adapter(model):
                # Any replica with LoRA on can load it (`policies/adapters.py` chooses where).
                parent = self._adapter_parents.get(model)
                view = tuple(
                    r
                    for r in self._replicas.values()
                    if r.routable and r.lora.enabled and (model in r.models or parent is None or parent in r.models)
                )
            else:
                view = tuple(r for r in self._replicas.values() if r.routable and model in r.models)
            self._views[model] = view
        return view

    def find_new_adapters(self) -> bool:
        """Reads the adapter folder again (`--lora-dir`) for adapters added since; True if any was."""
        folder = self._adapter_folder
        found = folder.reread() if folder is not None else None
        new = {name: path for name, path in (found or {}).items() if name not in self._configured_adapters}
        if new and folder is not None:
            self.adapter_paths.update(new)
            self._configured_adapters.update(new)
            self._reshaped()
            log.info("new adapters in %s: %s", folder.path, ", ".join(new))
        return bool(new)

    def is_adapter(self, model: str) -> bool:
        """Whether `model` names a LoRA adapter the router serves (cheap: read on every request)."""
        names = self._adapter_names
        if names is None:
            listed = {name for r in self._replicas.values() for name in adapter_cards(r.model_cards)}
            names = self._adapter_names = frozenset(self._configured_adapters | listed)
        return model in names

    def adapter_slots_of(self, replica: Replica) -> AdapterSlots:
        return replica.lora.slots(self.adapter_slots)

    def adapter_parent(self, adapter: str) -> str | None:
        """The base model an adapter runs on: as a replica listed it, else the one base model served."""
        parent = self._adapter_parents.get(adapter)
        if parent is not None:
            return parent
        return self.only_model()

    def routable_ids(self, model: str) -> tuple[str, ...]:
        """The ids of `routable(model)`, sorted; the same tuple object until routability changes."""
        ids = self._view_ids.get(model)
        if ids is None:
            ids = self._view_ids[model] = tuple(sorted(r.id for r in self.routable(model)))
        return ids

    def set_model_cards(self, replica_id: str, cards: tuple[dict[str, Any], ...]) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None and cards != replica.model_cards:
            replica.set_model_cards(cards)
            for name, card in adapter_cards(cards).items():
                if isinstance(card.get("root"), str) and card["root"]:
                    self.adapter_paths.setdefault(name, card["root"])
                self._adapter_parents[name] = card["parent"]
            self._reshaped()

    def _reshaped(self) -> None:
        """Which replicas are routable, or what they serve, may have changed."""
        self._views.clear()
        self._view_ids.clear()
        self._served = None
        self._adapter_names = None

    def known_models(self) -> list[str]:
        """Models any replica has ever reported, healthy now or not."""
        return list(self.model_cards(healthy_only=False))

    def model_cards(self, healthy_only: bool) -> dict[str, dict[str, Any]]:
        """Every model, then every adapter the router can load (loaded somewhere or not), as vLLM's cards."""
        cards: dict[str, dict[str, Any]] = {}
        lora_on = False
        for replica in self._replicas.values():
            if healthy_only and not replica.routable:
                continue
            lora_on = lora_on or replica.lora.enabled
            for card in replica.model_cards:
                cards.setdefault(str(card["id"]), card)
        if lora_on or not healthy_only:
            bases = [name for name, card in cards.items() if not card.get("parent")]
            for name in self._configured_adapters:
                path = self.adapter_paths[name]
                if name not in cards:
                    parent = self._adapter_parents.get(name) or (bases[0] if len(bases) == 1 else None)
                    cards[name] = adapter_card(name, path, parent, cards.get(parent or ""))
        return cards

    def candidates(self, model: str, exclude: Iterable[str] = ()) -> list[ReplicaView]:
        """Routable replicas serving `model`; those backing off (429/503) only when no other is left."""
        return self.available(self.routable(model), exclude)

    def available(
        self, replicas: Iterable[Replica], exclude: Iterable[str] = (), fresh_only: bool = False
    ) -> list[ReplicaView]:
        """`replicas` but the excluded; those backing off only when no other is left (never, with
        `fresh_only`). The live objects, for a decision made before the next await (see `ReplicaView`)."""
        excluded = set(exclude) if exclude else ()
        now = self._clock()
        fresh: list[ReplicaView] = []
        backed_off: list[ReplicaView] = []
        for r in replicas:
            if r.id not in excluded:
                (backed_off if r.health.backed_off(now) else fresh).append(r)
        return fresh if fresh or fresh_only else backed_off

    def acquire(self, replica_id: str) -> None:
        replica = self._replicas[replica_id]
        replica.in_flight += 1
        replica.served_total += 1

    def release(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.in_flight = max(0, replica.in_flight - 1)
        self._changed()

    def hold_adapter(self, replica_id: str, adapter: str) -> None:
        """A request of `adapter` was sent to the replica (perhaps waiting for the load): the adapter is
        not idle there until `release_adapter`."""
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.lora.started(adapter, self._clock())

    def release_adapter(self, replica_id: str, adapter: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.lora.finished(adapter, self._clock())
            if adapter not in replica.lora.in_flight:
                self._changed()  # idle now: a request waiting for an adapter slot may load there

    def set_lora_info(self, replica_id: str, max_loras: int, active: frozenset[str]) -> None:
        """What `vllm:lora_requests_info` said: its adapter slots, and the adapters running or waiting."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        lora = replica.lora
        was_enabled = lora.enabled
        if max_loras > 0:
            lora.max_loras = max_loras
        if lora.active != active:
            idle_now = bool(lora.active - active)
            lora.active = active
            if idle_now:
                self._changed()  # an adapter went idle: a request waiting for a slot may load now
        if lora.enabled != was_enabled:
            self._reshaped()

    def set_peer_in_flight(self, counts: dict[str, int]) -> None:
        """What the router's peers have in flight, per replica id (absent: none); sums over every peer."""
        fell = False
        for replica in self._replicas.values():
            count = counts.get(replica.id, 0)
            fell = fell or count < replica.peer_in_flight
            replica.peer_in_flight = count
        if fell:
            self._changed()  # a peer's requests ended there

    def probe_succeeded(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        if self._tracker.probe_succeeded(replica.health):
            self._reshaped()
            replica.last_error = None
            log.info("replica %s is healthy (models: %s)", replica.id, ", ".join(replica.models))
            self._changed()

    def probe_failed(self, replica_id: str, reason: str, refused: bool = False) -> None:
        """`refused`: nothing accepted the probe's connection. Listeners hear of it while the replica is
        still in routing, as they do of a refused request: a probe often finds a vanished replica first."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        replica.last_error = reason
        if refused and replica.healthy:
            self._tell_refused(replica_id)
        if self._tracker.probe_failed(replica.health, self._clock()):
            self._reshaped()
            log.warning("replica %s ejected: health probes failed (%s)", replica.id, reason)

    def observe(self, replica_id: str, outcome: Outcome, reason: str | None = None) -> None:
        """Passive health from a real request's result."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        if outcome is Outcome.OK:  # every answered request: nothing to scan, log or time
            self._tracker.succeeded(replica.health)
            return
        if outcome is not Outcome.CLIENT_ERROR and reason:
            replica.last_error = reason
        if outcome is Outcome.REFUSED:
            self._tell_refused(replica_id)
        # Scanned only for the outcomes it can spare from ejection, not on every request's success.
        last_standing = (
            outcome in SOFT_FAILURES
            and replica.routable
            and not any(r.routable for r in self._replicas.values() if r is not replica)
        )
        if self._tracker.observed(replica.health, outcome, self._clock(), last_standing):
            self._reshaped()
            log.warning("replica %s ejected: requests failed (%s)", replica.id, reason or outcome.value)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def record_scrape(
        self,
        replica_id: str,
        *,
        running: int,
        waiting: int,
        kv_usage: float,
        prefix_cache_queries: float,
        prefix_cache_hits: float,
        block_size: int | None,
        kv_blocks: int | None = None,
        scheduled: bool = True,
    ) -> None:
        """`scheduled` False: a read between the probes (held requests, `ReplicaMonitor`), which refreshes
        the load but does not teach the capacity, whose rules count scheduled scrapes (`capacity.py`)."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        replica.running = running
        replica.waiting = waiting
        replica.in_flight_at_scrape = replica.in_flight + replica.peer_in_flight
        if scheduled:
            replica.learned = learn(replica.learned, running, waiting, kv_usage, replica.in_flight_at_scrape)
        replica.kv_usage = kv_usage
        replica.prefix_cache_queries = prefix_cache_queries
        replica.prefix_cache_hits = prefix_cache_hits
        if block_size is not None:
            replica.block_size = block_size
        if kv_blocks is not None:
            replica.kv_blocks = kv_blocks
        replica.last_scrape = time.monotonic()
        # Every scrape, not only one that raised the capacity: load that was not this router's (other
        # routers, other clients) may have ended, and no answer of this router's would say so.
        self._changed()
