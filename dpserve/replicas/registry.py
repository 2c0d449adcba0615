"""The router's replicas: which exist, their health, and their load (in-flight counts, this router's and
its peers', and what their metrics say). What they serve is the catalog's (`replicas/catalog.py`)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from dpserve.gpu.placement import parse_replica_spec
from dpserve.policies.base import LoadFromCounts, ReplicaView
from dpserve.policies.latency import ReplicaLatency
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
    told_slots: int = 0
    """Requests it runs at once as the operator told the router (`--replica-max-num-seqs`); 0: not told."""
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
    latency: ReplicaLatency = field(default_factory=ReplicaLatency)
    """Its learned TTFT/TPOT model and the prompts sent there not yet answering (`policies/latency.py`)."""
    rank: int | None = None
    """One engine of a vLLM data-parallel server (`--data-parallel-size N`) at `url`: its data-parallel
    rank, which every request to it carries (`X-data-parallel-rank`). None: the server is one engine."""

    @property
    def where(self) -> str:
        """What names this replica across routers, whatever each calls it: its URL, and its rank."""
        return self.url if self.rank is None else f"{self.url}#dp{self.rank}"

    events_at: float | None = None
    """When its last KV-event batch came (monotonic): news of work on it that its last read may not show."""
    events_linked: bool = False
    """Its KV-event stream is connected now: were it to die, the disconnect would say so at once."""

    misconfigured: str | None = None
    """Why it refuses the router itself (its key, TLS): out of routing until a probe finds it usable."""

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def capacity(self) -> int:
        """Requests it runs at once (perhaps one more being tried); 0 while not known."""
        return self.learned.limit

    @property
    def slots(self) -> int:
        """Requests it runs at once as far as known: learned, else sighted, else told (`capacity.py`)."""
        return self.learned.sighted or self.told_slots

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
        return self.health.healthy and not self.draining and self.misconfigured is None

    @property
    def state(self) -> str:
        if self.draining:
            return "draining"
        if self.misconfigured is not None:
            return "misconfigured"
        if self.health.healthy:
            return "degraded" if self.degraded else "healthy"
        return "ejected" if self.health.ever_healthy else "starting"

    def set_model_cards(self, cards: tuple[dict[str, Any], ...]) -> None:
        """Call through `ModelCatalog.set_model_cards`, which keeps routing's cached views current."""
        self.model_cards = cards
        self.models = tuple(str(card["id"]) for card in cards)
        self.lora.listed(adapter_cards(cards))


def engine_id(server_id: str, rank: int) -> str:
    """The id of engine `rank` of the data-parallel server named `server_id` (`r0:dp1`)."""
    return f"{server_id}:dp{rank}"


def replica_id(index: int) -> str:
    """The name `dpserve up` and `dpserve compose` give their `index`-th replica (`--replica r0=URL`), so
    their tables, their Prometheus labels and the router's agree."""
    return f"r{index}"


def replica_ids(count: int) -> list[str]:
    """The names of `dpserve up`'s and `dpserve compose`'s replicas, in the order they start them."""
    return [replica_id(index) for index in range(count)]


REPLICA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def split_replica_name(spec: str) -> tuple[str | None, str]:
    """`NAME=URL[@gpu=N]` -> (NAME, the rest); a spec without a name -> (None, spec). A ValueError for a
    name that cannot be a metrics label value or a path segment."""
    name, sep, rest = spec.partition("=")
    if not sep or "://" in name or "://" not in rest:
        return None, spec
    if not REPLICA_NAME.fullmatch(name):
        raise ValueError(
            f"--replica {spec}: a NAME is 1 to 64 letters, digits, `.`, `_`, `:` or `-`, "
            "starting with a letter or digit"
        )
    return name, rest


ENGINES_MARKER = "@dp="


def split_engine_count(spec: str) -> tuple[str, int]:
    """`URL[@gpu=...]@dp=N` -> (the rest, N); a spec without the marker -> (spec, 1)."""
    rest, marker, count = spec.rpartition(ENGINES_MARKER)
    if not marker:
        return spec, 1
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"--replica {spec}: `{ENGINES_MARKER}` wants the server's --data-parallel-size, 1 or more")
    return rest, int(count)


def address_id(url: str) -> str:
    """A replica's default name: its address, `host:port`. The same replica has the same name in every
    router, whatever order they list it in, and across restarts."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or url
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ReplicaRegistry:
    """Replicas by id, their health and their load. A replica's id is the name it was given
    (`--replica NAME=URL`) or its address (`host:port`): the same in every router of a tier, in metrics,
    logs, receipts and traces, whatever order each lists it in.

    Listeners hear of three kinds of change: room (`on_change`: a waiting request may fit now), routability
    (`on_reshape`: who is in routing changed; the catalog rebuilds its views) and new replicas (`on_added`)."""

    def __init__(
        self,
        specs: Sequence[str],
        rules: HealthRules | None = None,
        clock: Callable[[], float] = time.monotonic,
        told_slots: int = 0,
    ) -> None:
        """`specs`: replica URLs, each optionally followed by `@gpu=N` (see `parse_replica_spec`); none
        where replicas are all discovered or added later. `told_slots`: what each runs at once, as told
        (`--replica-max-num-seqs`), until its own metrics show it."""
        self._replicas: dict[str, Replica] = {}
        self._told_slots = told_slots
        self._tracker = HealthTracker(rules or HealthRules())
        self._clock = clock
        self._room_listeners: list[Callable[[], None]] = []
        self._refused_listeners: list[Callable[[str], None]] = []
        self._reshape_listeners: list[Callable[[], None]] = []
        self._added_listeners: list[Callable[[Replica], None]] = []
        self.degraded_ids: frozenset[str] = frozenset()
        """Replicas whose GPU is unfit (`set_degraded`): read on every decision, so kept as a set."""
        self._counts_listeners: list[Callable[[], None]] = []
        self._busy: set[str] = set()
        """Replicas with requests of this router in flight: what peers hear of, without a scan of the fleet."""
        self._peer_busy: set[str] = set()
        self.reshapes = 0
        """How many times which replicas are routable (or exist) may have changed: a version for caches."""
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
        """`spec`: `[NAME=]URL[@gpu=N][@dp=N]`. Its id is NAME, else its address (`address_id`). With
        `@dp=N` it is a vLLM data-parallel server of N engines, each added as a replica (the first is
        returned); without, a server found to have several engines is split when its metrics show them."""
        name, rest = split_replica_name(spec)
        rest, engines = split_engine_count(rest)
        url, hint = parse_replica_spec(rest)
        if self.by_url(url) is not None:
            raise ValueError(f"{url} is already a replica")
        rid = name or address_id(url)
        if rid in self._replicas:
            raise ValueError(f"--replica {spec}: another replica is already named {rid}")
        replica = Replica(id=rid, url=url, gpu_hint=hint, told_slots=self._told_slots)
        self._replicas[replica.id] = replica
        if engines > 1:
            return self.split_engines(rid, range(engines))[0]
        for listener in self._added_listeners:
            listener(replica)
        self._reshaped()
        self.notify_room()
        return replica

    def at_url(self, url: str) -> list[Replica]:
        """The replica at `url`, or every engine of the data-parallel server there."""
        url = url.rstrip("/")
        return [r for r in self._replicas.values() if r.url == url]

    def split_engines(self, replica_id: str, ranks: Sequence[int]) -> list[Replica]:
        """The replica is a data-parallel server of these engines: each becomes a replica of its own
        (`engine_id`), pinned by its rank; the server's own entry goes. Its GPUs (`@gpu=...`) are dealt in
        rank order, as vLLM gives rank r the r-th share of the GPUs it sees."""
        server = self._replicas.pop(replica_id)
        self.degraded_ids = self.degraded_ids - {replica_id}
        share = len(server.gpu_hint) // len(ranks) if server.gpu_hint else 0
        engines = []
        for order, rank in enumerate(ranks):
            hint = server.gpu_hint[order * share : (order + 1) * share] if share else ()
            engine = Replica(
                id=engine_id(server.id, rank), url=server.url, gpu_hint=hint, rank=rank, told_slots=server.told_slots
            )
            engine.draining = server.draining
            self._replicas[engine.id] = engine
            engines.append(engine)
        for engine in engines:
            for listener in self._added_listeners:
                listener(engine)
        self._reshaped()
        self.notify_room()
        return engines

    def remove(self, replica_id: str) -> Replica:
        """Out of the registry at once; requests in flight on it finish (their release is a no-op)."""
        replica = self._replicas.pop(replica_id)
        self.degraded_ids = self.degraded_ids - {replica_id}
        self._reshaped()
        return replica

    def set_draining(self, replica_id: str, draining: bool) -> None:
        self._replicas[replica_id].draining = draining
        self._reshaped()
        self.notify_room()

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
            self.notify_room()
        return True

    def set_misconfigured(self, replica_id: str, cause: str | None) -> None:
        """Mark (the cause: it refused the router's key, its TLS failed) or clear (None) a replica that refuses
        the router itself. Marked, it is out of routing; the probes keep reading it and clear it."""
        replica = self._replicas.get(replica_id)
        if replica is None or replica.misconfigured == cause:
            return
        was = replica.misconfigured
        replica.misconfigured = cause
        if cause is not None:
            replica.last_error = cause
            log.error("replica %s is misconfigured, out of routing: %s", replica_id, cause)
        else:
            log.info("replica %s accepts the router again (was: %s)", replica_id, was)
        self._reshaped()
        if cause is None:
            self.notify_room()

    def misconfigured(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.misconfigured is not None and not r.draining]

    def on_change(self, listener: Callable[[], None]) -> None:
        """`listener` runs whenever a replica may have gained room: a slot freed (this router's, a peer's),
        a replica added or admitted, a scrape (load from elsewhere may have ended)."""
        self._room_listeners.append(listener)

    def on_refused(self, listener: Callable[[str], None]) -> None:
        """`listener(replica_id)` runs when nothing accepted a connection to a replica: it may be gone."""
        self._refused_listeners.append(listener)

    def on_reshape(self, listener: Callable[[], None]) -> None:
        """`listener` runs, before anything routes again, whenever which replicas are routable may have
        changed: one added, removed, drained, resumed, admitted or ejected."""
        self._reshape_listeners.append(listener)

    def on_added(self, listener: Callable[[Replica], None]) -> None:
        """`listener(replica)` runs for each replica added from now on, before it is routable."""
        self._added_listeners.append(listener)

    def on_counts(self, listener: Callable[[], None]) -> None:
        """`listener` runs whenever this router's in-flight count of a replica changes (what peers hear)."""
        self._counts_listeners.append(listener)

    def busy(self) -> list[Replica]:
        """The replicas with requests of this router in flight, without a scan of the fleet."""
        return [replica for rid in self._busy if (replica := self._replicas.get(rid)) is not None]

    def notify_room(self) -> None:
        """Tells the `on_change` listeners a replica may have gained room (also the catalog's to call: an
        adapter gone idle frees a slot)."""
        for listener in self._room_listeners:
            listener()

    def _tell_refused(self, replica_id: str) -> None:
        for listener in self._refused_listeners:
            listener(replica_id)

    def _reshaped(self) -> None:
        self.reshapes += 1
        for listener in self._reshape_listeners:
            listener()

    def healthy(self) -> list[Replica]:
        """Replicas routing may use: healthy and not draining."""
        return [r for r in self._replicas.values() if r.routable]

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
        self._busy.add(replica_id)
        for listener in self._counts_listeners:
            listener()

    def release(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.in_flight = max(0, replica.in_flight - 1)
            if not replica.in_flight:
                self._busy.discard(replica_id)
            for listener in self._counts_listeners:
                listener()
        self.notify_room()

    def hold_adapter(self, replica_id: str, adapter: str) -> None:
        """A request of `adapter` was sent to the replica (perhaps waiting for the load): the adapter is
        not idle there until `release_adapter`. Here with the other in-flight counts, which the request path
        keeps; which adapters a replica may serve is the catalog's."""
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.lora.started(adapter, self._clock())

    def release_adapter(self, replica_id: str, adapter: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.lora.finished(adapter, self._clock())
            if adapter not in replica.lora.in_flight:
                self.notify_room()  # idle now: a request waiting for an adapter slot may load there

    def set_peer_in_flight(self, counts: dict[str, int]) -> None:
        """What the router's peers have in flight, per replica id (absent: none); sums over every peer."""
        fell = False
        for rid in self._peer_busy | counts.keys():  # those with counts before or now, not the whole fleet
            replica = self._replicas.get(rid)
            if replica is None:
                continue
            count = counts.get(rid, 0)
            fell = fell or count < replica.peer_in_flight
            replica.peer_in_flight = count
        self._peer_busy = {rid for rid, count in counts.items() if count}
        if fell:
            self.notify_room()  # a peer's requests ended there

    def probe_succeeded(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        if self._tracker.probe_succeeded(replica.health):
            self._reshaped()
            replica.last_error = None
            log.info("replica %s is healthy (models: %s)", replica.id, ", ".join(replica.models))
            self.notify_room()

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
        self.notify_room()
