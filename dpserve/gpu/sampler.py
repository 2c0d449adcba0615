"""Samples every GPU through NVML on a background task; readers take the latest `GpuSnapshot`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from dpserve.background import cancel_and_wait
from dpserve.gpu.nvml import Nvml, NvmlReader, NvmlUnavailable, open_reader
from dpserve.gpu.placement import ReplicaClue, place_replicas
from dpserve.gpu.sample import GpuSnapshot

log = logging.getLogger("dpserve.gpu")

Clues = Callable[[], Sequence[ReplicaClue]]


class GpuSampler:
    """`sample_once` is blocking (NVML calls); `start` runs it in a worker thread every `interval_s`,
    so the event loop never waits on the driver. It never raises: failures become the snapshot's
    `unavailable` line or a GPU's `error`, and NVML is opened again later."""

    def __init__(
        self,
        load: Callable[[], Nvml],
        interval_s: float,
        *,
        clues: Clues = tuple,
        reopen_after_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._load = load
        self._interval_s = interval_s
        self._clues = clues
        self._reopen_after_s = reopen_after_s
        self._clock = clock
        self._reader: NvmlReader | None = None
        self._retry_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self.snapshot = GpuSnapshot()
        self.failures = 0
        """Whole-NVML failures since start (GPU-level errors are in the samples)."""
        self.on_sample: Callable[[], None] = lambda: None
        """Runs on the event loop after each background reading (the router rebuilds its GPU view)."""

    def sample_once(self) -> GpuSnapshot:
        now = self._clock()
        if self._reader is None:
            if now < self._retry_at:
                return self.snapshot
            reason = self._open()
            if reason is not None:
                self._retry_at = now + self._reopen_after_s
                return self._publish(GpuSnapshot(unavailable=reason, taken_at=now))
        assert self._reader is not None
        try:
            gpus = self._reader.read()
        except Exception as exc:  # NVML as a whole failed (driver gone, uninitialised): open it again next time
            self.failures += 1
            self._reader.close()
            self._reader = None
            return self._publish(GpuSnapshot(unavailable=f"NVML failed: {exc or type(exc).__name__}", taken_at=now))
        try:
            placed = place_replicas(self._clues(), gpus)
        except Exception:
            log.exception("could not tell which GPU each replica runs on")
            placed = {}
        return self._publish(GpuSnapshot(gpus=gpus, taken_at=now, replica_gpus=placed))

    def _open(self) -> str | None:
        try:
            self._reader = open_reader(self._load)
        except NvmlUnavailable as exc:
            return str(exc)
        return None

    def _publish(self, snapshot: GpuSnapshot) -> GpuSnapshot:
        before = self.snapshot
        if snapshot.unavailable and snapshot.unavailable != before.unavailable:
            log.warning("%s", snapshot.unavailable)  # one line per change, not one per tick
        elif snapshot.gpus and (before.unavailable or not before.gpus):
            log.info("sampling %d GPU(s) every %.1f s", len(snapshot.gpus), self._interval_s)
        lost_before = {g.index for g in before.gpus if not g.readable}
        for gpu in snapshot.gpus:
            if not gpu.readable and gpu.index not in lost_before:
                log.warning("GPU %d (%s) cannot be read: %s", gpu.index, gpu.uuid, gpu.error)
        self.snapshot = snapshot
        return snapshot

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="gpu-sampler")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._reader is not None:
            await asyncio.to_thread(self._reader.close)
            self._reader = None

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.sample_once)
                self.on_sample()
            except Exception:  # sample_once catches NVML's errors; anything else must not end sampling
                log.exception("GPU sampling failed")
            # Without NVML nothing changes before it is opened again: no wake-up (and rebuild) each interval.
            wait = self._retry_at - self._clock() if self._reader is None else 0.0
            await asyncio.sleep(max(self._interval_s, wait))
