"""The agent's reading: the host's NVML snapshot, each GPU process annotated with where it takes
connections (so a router elsewhere can tie the GPU to a replica URL) and its container or pod."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from dpserve.gpu.listeners import Reachable, reachable
from dpserve.gpu.sample import GpuProcess, GpuSample, GpuSnapshot


class ReachableCache:
    """`lookup` per pid, kept `ttl_s`: a replica's listening sockets do not move, and each lookup reads
    several /proc files (milliseconds on some kernels), every interval, for every GPU process."""

    def __init__(
        self,
        lookup: Callable[[int], Reachable] = reachable,
        ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lookup = lookup
        self._ttl_s = ttl_s
        self._clock = clock
        self._known: dict[int, tuple[float, Reachable]] = {}

    def __call__(self, pid: int) -> Reachable:
        now = self._clock()
        known = self._known.get(pid)
        if known is None or now - known[0] >= self._ttl_s:
            known = (now, self._lookup(pid))
            self._known[pid] = known
        return known[1]

    def keep_only(self, pids: set[int]) -> None:
        """Forget processes no longer on any GPU (a pid may be reused by another process later)."""
        for pid in [pid for pid in self._known if pid not in pids]:
            del self._known[pid]


def annotate(snapshot: GpuSnapshot, lookup: Callable[[int], Reachable] = reachable) -> GpuSnapshot:
    """`snapshot` with every process's listens, container and pod filled in (blocking: reads /proc)."""

    def one(process: GpuProcess) -> GpuProcess:
        found = lookup(process.pid)
        return dataclasses.replace(process, listens=found.listens, container=found.container, pod=found.pod)

    gpus = tuple(dataclasses.replace(gpu, processes=tuple(one(p) for p in gpu.processes)) for gpu in snapshot.gpus)
    return dataclasses.replace(snapshot, gpus=gpus)


def reading_json(snapshot: GpuSnapshot, host: str) -> dict[str, Any]:
    """What GET /gpus answers; the router's `parse_reading` reads it back."""
    return {
        "host": host,
        "taken_at": snapshot.taken_at,
        "unavailable": snapshot.unavailable,
        "gpus": [gpu.to_dict() for gpu in snapshot.gpus],
    }


def first_owner(gpu: GpuSample) -> GpuProcess | None:
    """The process to name in a GPU's `container`/`pod` labels: the first that runs in one."""
    return next((p for p in gpu.processes if p.container or p.pod), gpu.processes[0] if gpu.processes else None)
