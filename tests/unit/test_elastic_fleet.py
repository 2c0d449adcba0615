"""`dpserve up`'s elastic fleet choosing what to start, resume and drain (no sockets, no processes: its calls to
the routers are recorded, its replicas' processes stand-ins)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from dpserve.config import RouterSettings, UpSettings
from dpserve.up.elastic import ElasticFleet, Slot
from dpserve.up.launcher import DEFAULT_COLD_START_WAIT_S, elastic_settings
from dpserve.up.plan import PlanError, ReplicaPlan
from dpserve.up.process import ManagedProcess


class StandIn(ManagedProcess):
    """A process that starts and stops at once."""

    def __init__(self, name: str) -> None:
        super().__init__(name, ("true",), {}, None)
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1
        self.state = "starting"

    async def stop(self, grace_s: float) -> None:
        self.state = "stopped"


class Recorded(ElasticFleet):
    """The admin calls it would make, and a replica that is idle once `busy` is cleared."""

    def __init__(self, slots: Sequence[Slot], low: int, high: int) -> None:
        async def ready(proc: ManagedProcess) -> None:
            await asyncio.sleep(0)

        def supervise(proc: ManagedProcess) -> asyncio.Task[None]:
            return asyncio.get_running_loop().create_task(asyncio.sleep(3600))

        super().__init__(slots, ["http://router"], {}, {}, (low, high), ready, supervise, False, lambda line: None)
        self.calls: list[tuple[str, str]] = []
        self.busy: set[str] = set()

    async def _admin(
        self, method: str, path: str, body: dict[str, Any] | None = None, routers: Sequence[str] = ()
    ) -> None:
        self.calls.append((method, path))
        await asyncio.sleep(0)

    async def _idle(self, plan: ReplicaPlan) -> bool:
        return plan.id not in self.busy


def fleet(count: int, running: int) -> Recorded:
    slots = [
        Slot(ReplicaPlan(f"r{i}", 9000 + i, 9100 + i, "sim", {}, None, ("true",)), StandIn(f"r{i}"))
        for i in range(count)
    ]
    for slot in slots[:running]:
        slot.state = "ready"
    return Recorded(slots, 1, count)


async def settle(elastic: Recorded) -> None:
    tasks = [slot.task for slot in elastic.slots if slot.task is not None]
    await asyncio.gather(*tasks, return_exceptions=True)
    for slot in elastic.slots:
        if slot.supervisor is not None:
            slot.supervisor.cancel()


async def test_scaling_up_by_several_starts_as_many_distinct_replicas() -> None:
    """Found by review: the state was set inside each start's task, so one reconcile picked the same stopped
    slot again, and the second start cancelled the first: a jump from 1 to 4 started one replica."""
    elastic = fleet(4, 1)
    elastic.reconcile(4)
    assert [slot.state for slot in elastic.slots] == ["ready", "starting", "starting", "starting"]
    await settle(elastic)
    assert [slot.state for slot in elastic.slots] == ["ready"] * 4
    assert [slot.proc.starts for slot in elastic.slots if isinstance(slot.proc, StandIn)] == [0, 1, 1, 1]
    added = [path for method, path in elastic.calls if method == "POST" and path == "/admin/replicas"]
    assert len(added) == 3  # each told to the routers once, then resumed (probed) once it answers
    assert sum(1 for _, path in elastic.calls if path.endswith("/resume")) == 3


async def test_the_newest_drain_first_and_a_draining_one_is_resumed_before_any_start() -> None:
    elastic = fleet(4, 4)
    elastic.busy = {"r3", "r2"}  # streams on them: drained, not stopped
    elastic.reconcile(2)
    assert [slot.state for slot in elastic.slots] == ["ready", "ready", "draining", "draining"]
    await asyncio.sleep(0.01)
    assert [slot.state for slot in elastic.slots] == ["ready", "ready", "draining", "draining"]
    elastic.reconcile(3)  # back up: r2 is warm, resumed; nothing starts
    assert [slot.state for slot in elastic.slots] == ["ready", "ready", "ready", "draining"]
    elastic.busy = set()
    await settle(elastic)
    assert [slot.state for slot in elastic.slots] == ["ready", "ready", "ready", "stopped"]
    assert ("DELETE", "/admin/replicas/r3") in elastic.calls and ("DELETE", "/admin/replicas/r2") not in elastic.calls
    assert all(slot.proc.starts == 0 for slot in elastic.slots if isinstance(slot.proc, StandIn))


async def test_a_replica_still_starting_goes_first_and_without_a_drain() -> None:
    elastic = fleet(3, 1)
    elastic.reconcile(2)
    elastic.reconcile(1)  # before r1 served
    await settle(elastic)
    assert [slot.state for slot in elastic.slots] == ["ready", "stopped", "stopped"]
    assert ("POST", "/admin/replicas/r1/drain") not in elastic.calls
    assert ("DELETE", "/admin/replicas/r1") in elastic.calls


def test_elastic_settings_plan_for_the_most_and_start_from_zero_with_a_wait() -> None:
    both = elastic_settings(UpSettings(min_replicas=0, max_replicas=3, sim_replicas=1))
    assert both.elastic and both.num_replicas == 3 and both.sim_replicas == 3
    assert both.router.cold_start_wait_s == DEFAULT_COLD_START_WAIT_S and not both.router.admin_keys
    given = elastic_settings(UpSettings(min_replicas=0, max_replicas=3, router=RouterSettings(cold_start_wait_s=9)))
    assert given.router.cold_start_wait_s == 9
    only_max = elastic_settings(UpSettings(max_replicas=4))
    assert only_max.elastic and only_max.fewest_replicas == 1 and only_max.router.cold_start_wait_s == 0
    fixed = elastic_settings(UpSettings(min_replicas=2, max_replicas=2))
    assert not fixed.elastic and fixed.num_replicas == 2
    assert elastic_settings(UpSettings(num_replicas=3)) == UpSettings(num_replicas=3)


def test_elastic_settings_give_the_launcher_an_admin_key_where_keys_are_on() -> None:
    keyed = elastic_settings(UpSettings(max_replicas=2, router=RouterSettings(api_keys=("client-key-123",))))
    assert len(keyed.router.admin_keys) == 1 and len(keyed.router.admin_keys[0]) >= 24
    again = elastic_settings(UpSettings(max_replicas=2, router=RouterSettings(api_keys=("client-key-123",))))
    assert again.router.admin_keys != keyed.router.admin_keys  # new each run
    own = RouterSettings(api_keys=("client-key-123",), admin_keys=("admin-key-456",))
    assert elastic_settings(UpSettings(max_replicas=2, router=own)).router.admin_keys == ("admin-key-456",)


def test_elastic_settings_refuse_what_cannot_scale() -> None:
    with pytest.raises(PlanError, match="--engine-dp runs one server"):
        elastic_settings(UpSettings(max_replicas=2, engine_dp=True))
    with pytest.raises(ValueError, match="--min-replicas 3 is more than --max-replicas 2"):
        UpSettings(min_replicas=3, max_replicas=2)
