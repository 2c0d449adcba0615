"""The probe schedule at scale: probes spread over the interval, quiet replicas read less often, a dropped
KV-event stream probed at once. The replicas are a scripted session (no sockets)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter

import orjson

from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.monitor import QUIET_MODELS_EVERY, ProbeFailed, ReplicaMonitor, quiet
from dpserve.replicas.registry import Replica, ReplicaRegistry

METRICS = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"


class ScriptedReplicas:
    """`ReplicaReads` that counts each path read (health, metrics, models); `down` replicas' reads fail."""

    def __init__(self) -> None:
        self.reads: Counter[tuple[str, str]] = Counter()
        self.down: set[str] = set()

    async def get(self, base_url: str, path: str) -> tuple[int, bytes]:
        name = "models" if path == "/v1/models" else path.lstrip("/")
        self.reads[(base_url, name)] += 1
        if base_url in self.down:
            raise ProbeFailed("connection refused", refused=True)
        if name == "models":
            return 200, orjson.dumps({"data": [{"id": "m"}]})
        return 200, METRICS.encode() if name == "metrics" else b""


def fleet(
    count: int, quiet_s: float = 5.0, interval_s: float = 1.0, linked_quiet_s: float = 0.0
) -> tuple[ReplicaRegistry, ScriptedReplicas, ReplicaMonitor]:
    registry = ReplicaRegistry([f"http://10.0.0.{i}:8000" for i in range(count)])
    replicas = ScriptedReplicas()
    catalog = ModelCatalog(registry)
    monitor = ReplicaMonitor(
        registry, catalog, replicas, interval_s, quiet_interval_s=quiet_s, linked_quiet_interval_s=linked_quiet_s
    )
    return registry, replicas, monitor


async def settle(monitor: ReplicaMonitor) -> None:
    while monitor._tasks:
        await asyncio.gather(*list(monitor._tasks))


def test_a_quiet_replica_is_healthy_idle_and_read_since_its_last_events() -> None:
    replica = Replica("r0", "http://h:1")
    assert not quiet(replica)  # never read
    replica.health.healthy = True
    replica.last_scrape = 10.0
    assert quiet(replica)
    for change in ("in_flight", "peer_in_flight", "running", "waiting"):
        setattr(replica, change, 1)
        assert not quiet(replica), change
        setattr(replica, change, 0)
    replica.events_at = 11.0  # events since the last read: work on it the read did not see
    assert not quiet(replica)
    replica.events_at = 9.0
    replica.draining = True
    assert not quiet(replica)


async def test_quiet_replicas_are_read_every_quiet_interval_and_busy_ones_every_cycle() -> None:
    registry, replicas, monitor = fleet(3)
    await monitor.probe_all()  # cycle 0: every replica read in full
    linked, unlinked, busy = list(registry)
    linked.events_linked = True
    busy.in_flight = 1
    replicas.reads.clear()
    for cycle in range(1, 11):
        monitor._visit(list(registry), cycle)
        await settle(monitor)
    assert replicas.reads[(busy.url, "health")] == 10 and replicas.reads[(busy.url, "metrics")] == 10
    # No KV-event stream to say it died: its /health every cycle, its /metrics every 5th.
    assert replicas.reads[(unlinked.url, "health")] == 10 and replicas.reads[(unlinked.url, "metrics")] == 2
    # Its stream would tell of a death, its events of work: /health alone every 5th cycle.
    assert replicas.reads[(linked.url, "health")] == 2 and replicas.reads[(linked.url, "metrics")] == 0
    assert monitor.stats.skipped == 8


async def test_a_quiet_replica_with_its_kv_events_connected_is_read_every_linked_interval() -> None:
    registry, replicas, monitor = fleet(2, quiet_s=5.0, linked_quiet_s=10.0)
    await monitor.probe_all()
    linked, unlinked = list(registry)
    linked.events_linked = True
    replicas.reads.clear()
    for cycle in range(1, 21):
        monitor._visit(list(registry), cycle)
        await settle(monitor)
    assert replicas.reads[(linked.url, "health")] == 2 and replicas.reads[(linked.url, "metrics")] == 0
    assert replicas.reads[(unlinked.url, "health")] == 20 and replicas.reads[(unlinked.url, "metrics")] == 4
    linked.events_linked = False  # its stream dropped: back to the quiet interval, /health every cycle
    replicas.reads.clear()
    for cycle in range(21, 31):
        monitor._visit(list(registry), cycle)
        await settle(monitor)
    assert replicas.reads[(linked.url, "health")] == 10 and replicas.reads[(linked.url, "metrics")] == 2


async def test_a_linked_quiet_replica_has_its_models_read_on_a_longer_schedule() -> None:
    registry, replicas, monitor = fleet(2, quiet_s=5.0, linked_quiet_s=10.0)  # models every 30 cycles
    await monitor.probe_all()
    linked, busy = list(registry)
    linked.events_linked = True
    busy.in_flight = 1
    replicas.reads.clear()
    cycles = 10 * QUIET_MODELS_EVERY
    for cycle in range(1, cycles + 1):
        monitor._visit(list(registry), cycle)
        await settle(monitor)
    assert replicas.reads[(linked.url, "health")] == QUIET_MODELS_EVERY
    assert replicas.reads[(linked.url, "models")] == 1  # its 10th visit
    assert replicas.reads[(busy.url, "models")] == cycles // 30


async def test_anything_that_stirs_a_quiet_replica_brings_it_back_to_every_cycle() -> None:
    registry, replicas, monitor = fleet(1)
    await monitor.probe_all()
    replica = next(iter(registry))
    replica.events_linked = True
    monitor._visit([replica], 1)
    await settle(monitor)
    monitor.events_seen(replica.id)  # a KV event after its last read
    replicas.reads.clear()
    monitor._visit([replica], 2)
    await settle(monitor)
    assert replicas.reads[(replica.url, "metrics")] == 1
    monitor._visit([replica], 3)  # read since: quiet again
    await settle(monitor)
    assert replicas.reads[(replica.url, "metrics")] == 1


async def test_without_a_quiet_interval_every_replica_is_read_every_cycle() -> None:
    registry, replicas, monitor = fleet(2, quiet_s=0.0)
    await monitor.probe_all()
    replicas.reads.clear()
    for cycle in range(1, 4):
        monitor._visit(list(registry), cycle)
        await settle(monitor)
    assert all(replicas.reads[(r.url, path)] == 3 for r in registry for path in ("health", "metrics"))


async def test_probes_are_spread_over_the_interval() -> None:
    registry, _, monitor = fleet(4, interval_s=0.4)
    visits: list[tuple[float, list[str]]] = []
    monitor._visit = lambda replicas, cycle: visits.append((time.monotonic(), [r.id for r in replicas]))  # type: ignore[method-assign]
    monitor.start()
    await asyncio.sleep(0.45)
    await monitor.stop()
    assert [ids for _, ids in visits[:4]] == [[r.id] for r in registry]
    # A quarter of the interval apart (sleeps end no sooner than asked), not all at once.
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(visits[:4])]
    assert all(gap > 0.07 for gap in gaps), gaps


async def test_a_dropped_event_stream_gets_the_replica_probed_at_once_and_ejected() -> None:
    registry, replicas, monitor = fleet(2)  # not started: no scheduled probe comes in this test
    await monitor.probe_all()
    dead, alive = list(registry)
    replicas.down.add(dead.url)
    monitor.events_link(dead.id, False)
    monitor.events_link(alive.id, False)  # a stream that only reconnects: one probe, it answers
    await settle(monitor)
    assert not dead.healthy and replicas.reads[(dead.url, "health")] == 3  # probe_all's, then 2 in a row
    assert alive.healthy and replicas.reads[(alive.url, "health")] == 2  # probe_all's and this one
