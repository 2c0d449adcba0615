"""Per-GPU Prometheus gauges, read from the sampler's latest snapshot at scrape time.

Meanings follow NVIDIA's DCGM exporter (GPU_UTIL, MEM_COPY_UTIL, FB_USED, POWER_USAGE, GPU_TEMP,
SM_CLOCK), in base units and with `gpu`, `uuid` and `replica` labels."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.gpu.sample import GpuSample, GpuSnapshot

LABELS = ["gpu", "uuid", "replica"]
MHZ = 1_000_000

# (metric name, help, how to read it off a sample)
GAUGES: tuple[tuple[str, str, Callable[[GpuSample], float | None]], ...] = (
    (
        "dpserve_gpu_utilization_ratio",
        "Fraction of the last sample period in which a kernel ran on the GPU (DCGM GPU_UTIL / 100).",
        lambda g: g.utilization_gpu,
    ),
    (
        "dpserve_gpu_memory_utilization_ratio",
        "Fraction of the last sample period in which device memory was read or written (DCGM MEM_COPY_UTIL / 100).",
        lambda g: g.utilization_memory,
    ),
    ("dpserve_gpu_memory_used_bytes", "Device memory in use (DCGM FB_USED, in bytes).", lambda g: g.memory_used_bytes),
    ("dpserve_gpu_memory_total_bytes", "Device memory in all.", lambda g: g.memory_total_bytes),
    ("dpserve_gpu_power_watts", "Power draw (DCGM POWER_USAGE).", lambda g: g.power_watts),
    ("dpserve_gpu_power_limit_watts", "Enforced power limit.", lambda g: g.power_limit_watts),
    ("dpserve_gpu_temperature_celsius", "GPU temperature (DCGM GPU_TEMP).", lambda g: g.temperature_celsius),
    (
        "dpserve_gpu_sm_clock_hertz",
        "SM clock (DCGM SM_CLOCK, in Hz).",
        lambda g: None if g.sm_clock_mhz is None else g.sm_clock_mhz * MHZ,
    ),
)


class GpuCollector(Collector):
    def __init__(self, snapshot: Callable[[], GpuSnapshot], failures: Callable[[], int]) -> None:
        self._snapshot = snapshot
        self._failures = failures

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        families = [(GaugeMetricFamily(name, doc, labels=LABELS), read) for name, doc, read in GAUGES]
        up = GaugeMetricFamily(
            "dpserve_gpu_up", "1 when the GPU answered its last NVML reading, 0 when not (lost, say).", labels=LABELS
        )
        for gpu in snapshot.gpus:
            labels = [str(gpu.index), gpu.uuid, snapshot.replica_of(gpu.index) or ""]
            up.add_metric(labels, 1.0 if gpu.readable else 0.0)
            for family, read in families:
                value = read(gpu)
                if value is not None:
                    family.add_metric(labels, float(value))
        yield from (family for family, _ in families)
        yield up
        yield GaugeMetricFamily(
            "dpserve_gpus", "GPUs NVML reported at the last sample (0 without a GPU or NVML).", value=len(snapshot.gpus)
        )
        yield CounterMetricFamily(
            "dpserve_gpu_sampler_failures",
            "Times NVML as a whole failed a reading and was opened again.",
            value=self._failures(),
        )
