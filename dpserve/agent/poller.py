"""Reads NVML on a worker thread every interval (the router's own `GpuSampler`) and annotates each
GPU process with /proc facts; handlers read `latest`, never the driver."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dpserve.agent.reading import ReachableCache, annotate
from dpserve.background import cancel_and_wait
from dpserve.gpu.listeners import Reachable, reachable
from dpserve.gpu.sample import GpuSnapshot
from dpserve.gpu.sampler import GpuSampler

log = logging.getLogger("dpserve.agent")


class AgentPoller:
    def __init__(self, sampler: GpuSampler, interval_s: float, lookup: Callable[[int], Reachable] = reachable):
        self._sampler = sampler
        self._interval_s = interval_s
        self._lookup = ReachableCache(lookup)
        self._task: asyncio.Task[None] | None = None
        self.latest = GpuSnapshot()

    def read_once(self) -> GpuSnapshot:
        """Blocking: one NVML reading, annotated. Never raises (the sampler turns failures into lines)."""
        snapshot = self._sampler.sample_once()
        try:
            snapshot = annotate(snapshot, self._lookup)
            self._lookup.keep_only({p.pid for gpu in snapshot.gpus for p in gpu.processes})
        except Exception:  # /proc read failed oddly: serve the reading without process addresses
            log.exception("could not tell where the GPU processes listen")
        self.latest = snapshot
        return snapshot

    async def start(self) -> None:
        await asyncio.to_thread(self.read_once)  # the first request finds a reading
        self._task = asyncio.create_task(self._run(), name="agent-poller")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        await self._sampler.stop()  # closes NVML

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await asyncio.to_thread(self.read_once)
