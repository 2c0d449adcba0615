"""`dpserve up --min-replicas A --max-replicas B`: the launcher's replicas follow the routers' desired-replicas
signal (`/admin/scale`). A replica starts on a free slot (GPU, CPU core set, simulator port) and is told to
the routers (`POST /admin/replicas`) at once, so they count it as starting; once it answers, they probe it
and route to it. One that is no longer needed is drained on every router, then stopped only when no router
has a request on it and its own metrics show nothing running or waiting (clients that bypass the routers
included), so no stream is cut; if the signal rises meanwhile, it is resumed instead."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from dpserve.replicas.prometheus_text import parse_samples
from dpserve.up.plan import ReplicaPlan
from dpserve.up.process import ManagedProcess

log = logging.getLogger("dpserve.up")

SIGNAL_WAIT_S = 10.0
"""Each long poll of `/admin/scale` waits this long for a change."""
DRAIN_CHECK_S = 0.25
DRAIN_LIMIT_S = 600.0
"""A drained replica is stopped after this long even if a request still runs there (a stuck client)."""
RETRY_S = 1.0
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass
class Slot:
    """One replica the launcher may run: its plan, its process, and what the elastic fleet does with it."""

    plan: ReplicaPlan
    proc: ManagedProcess
    state: str = "stopped"
    """stopped, starting, ready, draining, stopping (drained, out of the routers)."""
    task: asyncio.Task[None] | None = None
    """Its start or its drain, while one runs."""
    supervisor: asyncio.Task[None] | None = None
    """Restarts it if it dies while it serves."""
    startup_s: float | None = None

    @property
    def active(self) -> bool:
        return self.state in ("starting", "ready")


class ElasticFleet:
    def __init__(
        self,
        slots: Sequence[Slot],
        routers: Sequence[str],
        admin_headers: dict[str, str],
        replica_headers: dict[str, str],
        bounds: tuple[int, int],
        wait_ready: Callable[[ManagedProcess], Awaitable[None]],
        supervise: Callable[[ManagedProcess], asyncio.Task[None]],
        kv_events: bool,
        report: Callable[[str], None],
    ) -> None:
        self.slots = list(slots)
        self._routers = list(routers)
        self._admin_headers, self._replica_headers = admin_headers, replica_headers
        self.low, self.high = bounds
        self._wait_ready, self._supervise = wait_ready, supervise
        self._kv_events = kv_events
        self._report = report
        self.desired = sum(1 for slot in self.slots if slot.active)
        self._on_command_line = frozenset(slot.plan.id for slot in self.slots if slot.active)
        """The replicas the routers were started with (`--replica`): a restarted router knows these."""
        self._session: aiohttp.ClientSession | None = None

    async def run(self, stopping: asyncio.Event) -> None:
        """Follows the signal until `stopping`; then every start or drain under way is cancelled."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SIGNAL_WAIT_S + 10)) as session:
            self._session = session
            try:
                await self._follow(stopping)
            finally:
                tasks = [slot.task for slot in self.slots if slot.task is not None]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, stopping: asyncio.Event) -> None:
        versions = [-1] * len(self._routers)
        while not stopping.is_set():
            answers = await asyncio.gather(
                *(self._signal(url, version) for url, version in zip(self._routers, versions, strict=True))
            )
            said = [answer for answer in answers if answer is not None]
            if not said:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), RETRY_S)
                continue
            versions = [answer["version"] if answer else -1 for answer in answers]
            # Peered routers count each other's held requests; the fleet is sized for the one that needs most.
            wanted = max(int(answer["desired"]) for answer in said)
            self.reconcile(min(self.high, max(self.low, wanted)))

    async def _signal(self, router: str, version: int) -> dict[str, Any] | None:
        assert self._session is not None
        wait = SIGNAL_WAIT_S if version >= 0 else 0
        try:
            async with self._session.get(
                f"{router}/admin/scale", params={"after": str(version), "wait": str(wait)}, headers=self._admin_headers
            ) as resp:
                if resp.status != 200:
                    log.warning("%s/admin/scale answered %d", router, resp.status)
                    await asyncio.sleep(RETRY_S)
                    return None
                answer: dict[str, Any] = await resp.json()
                return answer
        except (aiohttp.ClientError, TimeoutError):
            await asyncio.sleep(RETRY_S)  # a router restarting: its supervisor brings it back
            return None

    def reconcile(self, desired: int) -> None:
        """Starts, resumes or drains replicas until as many are active as `desired` (bounds applied)."""
        self._report_once(desired)
        self.desired = desired
        active = [slot for slot in self.slots if slot.active]
        # Each slot's new state is set here, before its work runs: the next pick of this loop sees it.
        for _ in range(desired - len(active)):
            draining = [slot for slot in self.slots if slot.state == "draining"]
            stopped = [slot for slot in self.slots if slot.state == "stopped"]
            if draining:  # still warm: back into routing, no start-up to wait for
                draining[0].state = "ready"
                self._begin(draining[0], self._resume)
            elif stopped:
                stopped[0].state = "starting"
                self._begin(stopped[0], self._start)
        # The newest go first: the oldest keep their warm caches. A replica still starting is stopped first.
        extra = sorted(active, key=lambda slot: (slot.state == "ready", -self.slots.index(slot)))
        for slot in extra[: max(0, len(active) - desired)]:
            serving, slot.state = slot.state == "ready", "draining"
            self._begin(slot, self._drain if serving else self._stop_start)

    def _report_once(self, desired: int) -> None:
        if desired != self.desired:
            self._report(f"dpserve: the routers ask for {desired} replica(s) (were {self.desired})")

    def _begin(self, slot: Slot, work: Callable[[Slot], Awaitable[None]]) -> None:
        """`work(slot)` once the slot's previous work is cancelled (made only then: one cancelled before it
        ran was never made)."""
        previous = slot.task
        if previous is not None and previous is not asyncio.current_task():  # a drain that just ended asks
            previous.cancel()

        async def run() -> None:
            if previous is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await previous
            await work(slot)

        slot.task = asyncio.get_running_loop().create_task(run(), name=f"elastic-{slot.plan.id}")

    async def _admin(
        self, method: str, path: str, body: dict[str, Any] | None = None, routers: Sequence[str] = ()
    ) -> None:
        """The same admin call on every router (or on `routers`); one that fails is logged."""
        session = self._session
        assert session is not None

        async def one(router: str) -> None:
            try:
                async with session.request(method, router + path, json=body, headers=self._admin_headers) as resp:
                    if resp.status >= 400 and not (resp.status == 404 and method == "DELETE"):
                        log.warning("%s %s%s: %d %s", method, router, path, resp.status, await resp.text())
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("%s %s%s: %s", method, router, path, exc)

        await asyncio.gather(*(one(router) for router in routers or self._routers))

    def _added(self, plan: ReplicaPlan) -> dict[str, Any]:
        """`POST /admin/replicas`' body for it: its name, its GPU, its KV events."""
        target = plan.router_target
        body: dict[str, Any] = {"url": plan.url, "name": plan.id}
        if target.gpu is not None:
            body["gpu"] = target.gpu
        if self._kv_events:
            body["kv_events"] = target.kv_events
        return body

    async def router_back(self, router: str) -> None:
        """A router restarted knows only the replicas on its command line: told of the others again."""
        for slot in self.slots:
            if slot.state == "stopped" or slot.plan.id in self._on_command_line:
                continue
            await self._admin("POST", "/admin/replicas", self._added(slot.plan), [router])
            if slot.state == "ready":
                await self._admin("POST", f"/admin/replicas/{slot.plan.id}/resume", routers=[router])
            elif slot.state == "draining":
                await self._admin("POST", f"/admin/replicas/{slot.plan.id}/drain", routers=[router])
        for slot in self.slots:  # those on its command line may be draining, or stopped, since
            if slot.plan.id in self._on_command_line and slot.state != "ready":
                await self._admin("DELETE", f"/admin/replicas/{slot.plan.id}", routers=[router])

    async def _start(self, slot: Slot) -> None:
        plan, proc = slot.plan, slot.proc
        began = time.monotonic()
        await proc.start()
        await self._admin("POST", "/admin/replicas", self._added(plan))  # the routers count it as starting
        try:
            await self._wait_ready(proc)
        except Exception as exc:  # it exited, or never answered: out of the routers, its slot free
            self._report(f"dpserve: {plan.id} did not start: {exc}")
            await self._admin("DELETE", f"/admin/replicas/{plan.id}")
            await proc.stop(5.0)
            slot.state = "stopped"
            return  # not retried at once: the next change of the signal (or its next answer) tries again
        await self._admin("POST", f"/admin/replicas/{plan.id}/resume")  # probed now: it serves at once
        slot.startup_s = time.monotonic() - began  # spawn to serving through the routers
        slot.state = "ready"
        slot.supervisor = self._supervise(proc)
        self._report(f"dpserve: {plan.id} started in {slot.startup_s:.1f} s ({self._count()})")

    async def _resume(self, slot: Slot) -> None:
        await self._admin("POST", f"/admin/replicas/{slot.plan.id}/resume")
        self._report(f"dpserve: {slot.plan.id} resumed before it stopped ({self._count()})")

    async def _stop_start(self, slot: Slot) -> None:
        """A replica let go while it starts: nothing to drain, its start is stopped."""
        await self._drain(slot, serving=False)

    async def _drain(self, slot: Slot, serving: bool = True) -> None:
        plan, proc = slot.plan, slot.proc
        if serving:
            await self._admin("POST", f"/admin/replicas/{plan.id}/drain")
            began = time.monotonic()
            while not await self._idle(plan) and time.monotonic() - began < DRAIN_LIMIT_S:
                await asyncio.sleep(DRAIN_CHECK_S)
        slot.state = "stopping"  # out of the routers from here on: no resuming it, a new start once stopped
        await self._admin("DELETE", f"/admin/replicas/{plan.id}")
        if slot.supervisor is not None:
            slot.supervisor.cancel()
            slot.supervisor = None
        await proc.stop(30.0)
        slot.state = "stopped"
        self._report(f"dpserve: {plan.id} drained and stopped ({self._count()})")
        self.reconcile(self.desired)  # the signal may have risen while it stopped

    async def _idle(self, plan: ReplicaPlan) -> bool:
        """No router has a request on it, and it runs and queues none (from anyone)."""
        assert self._session is not None
        for router in self._routers:
            try:
                async with self._session.get(f"{router}/admin/replicas", headers=self._admin_headers) as resp:
                    replicas = (await resp.json())["replicas"] if resp.status == 200 else []
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return False
            if any(entry.get("id") == plan.id and entry.get("in_flight", 0) > 0 for entry in replicas):
                return False
        try:
            async with self._session.get(f"{plan.url}/metrics", headers=self._replica_headers) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return True  # it is gone already: nothing to wait for
        samples = parse_samples(text, BUSY)
        return all((samples.total(name) or 0) == 0 for name in BUSY)

    def _count(self) -> str:
        states = [slot.state for slot in self.slots]
        shown = {state: states.count(state) for state in ("ready", "starting", "draining") if states.count(state)}
        return ", ".join(f"{count} {state}" for state, count in shown.items()) or "none running"
