"""One replica's GPUs as one reading: a tensor-parallel replica (`--tensor-parallel-size K`) runs on K GPUs,
and the router shows and exports them together beside each GPU's own reading.

How each is combined, and why:
- utilization (kernel time, memory traffic): the **max**. Every step of a tensor-parallel model ends in
  all-reduces among all K ranks, so the replica moves at its busiest GPU's pace; a mean would hide one GPU
  pegged (a straggler, another process on it) behind idle peers and call the replica half free.
- memory used and total, power: **summed**: the replica holds its weights and KV cache across all K.
- temperature: the max (the hottest GPU throttles first).
A value is given only when every GPU of the replica gave its own: a sum or max over the GPUs still read,
with one lost, would show a lighter replica than there is. `readable` says how many answered."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dpserve.gpu.sample import GpuSample


@dataclass(frozen=True)
class ReplicaGpus:
    gpus: int
    readable: int
    """How many of them answered their last reading."""
    utilization_gpu: float | None = None
    """The busiest GPU's kernel-time fraction (0..1)."""
    utilization_memory: float | None = None
    """The busiest GPU's memory-traffic fraction (0..1)."""
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _every(samples: Sequence[GpuSample], read: Callable[[GpuSample], float | None]) -> list[float] | None:
    """Each GPU's value, or None when any GPU (or none at all) gave it."""
    values = [read(sample) for sample in samples]
    known = [value for value in values if value is not None]
    return known if samples and len(known) == len(values) else None


def _max(samples: Sequence[GpuSample], read: Callable[[GpuSample], float | None]) -> float | None:
    values = _every(samples, read)
    return None if values is None else max(values)


def _sum(samples: Sequence[GpuSample], read: Callable[[GpuSample], float | None]) -> float | None:
    values = _every(samples, read)
    return None if values is None else sum(values)


def _bytes(total: float | None) -> int | None:
    return None if total is None else int(total)


def combine_gpus(samples: Sequence[GpuSample]) -> ReplicaGpus:
    """The replica's reading from its GPUs' (one GPU: its own values)."""
    return ReplicaGpus(
        gpus=len(samples),
        readable=sum(1 for sample in samples if sample.readable),
        utilization_gpu=_max(samples, lambda g: g.utilization_gpu),
        utilization_memory=_max(samples, lambda g: g.utilization_memory),
        memory_used_bytes=_bytes(_sum(samples, lambda g: g.memory_used_bytes)),
        memory_total_bytes=_bytes(_sum(samples, lambda g: g.memory_total_bytes)),
        power_watts=_sum(samples, lambda g: g.power_watts),
        temperature_celsius=_max(samples, lambda g: g.temperature_celsius),
    )
