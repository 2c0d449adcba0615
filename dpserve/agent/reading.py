"""The agent's reading: the host's NVML snapshot, each GPU process annotated with where it takes
connections (so a router elsewhere can tie the GPU to a replica URL) and its container or pod."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dpserve.gpu.listeners import Reachable, reachable
from dpserve.gpu.sample import GpuProcess, GpuSample, GpuSnapshot


def annotate(snapshot: GpuSnapshot, lookup: Callable[[int], Reachable] = reachable) -> GpuSnapshot:
    """`snapshot` with every process's listens, container and pod filled in (blocking: reads /proc)."""
    cache: dict[int, Reachable] = {}

    def one(process: GpuProcess) -> GpuProcess:
        if process.pid not in cache:
            cache[process.pid] = lookup(process.pid)
        found = cache[process.pid]
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
