"""Per-GPU Prometheus gauges for the whole fleet (this host and the GPU agents'), read at scrape time.

Meanings follow NVIDIA's DCGM exporter (GPU_UTIL, MEM_COPY_UTIL, FB_USED, POWER_USAGE, GPU_TEMP,
SM_CLOCK, XID_ERRORS, ECC_DBE_VOL_TOTAL, CLOCK_THROTTLE_REASONS, PCIE_LINK_*), in base units and with
`gpu`, `uuid`, `replica` and `host` labels (host: empty for the router's own)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.gpu.combined import ReplicaGpus
from dpserve.gpu.sample import GpuSample
from dpserve.router.fleet.gpus import GpuFleet

LABELS = ["gpu", "uuid", "replica", "host"]
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
    ("dpserve_gpu_xid_errors", "Xid errors seen since the reader started (DCGM XID_ERRORS).", lambda g: g.xid_errors),
    (
        "dpserve_gpu_ecc_uncorrected_errors",
        "Uncorrected ECC errors since the driver loaded (DCGM ECC_DBE_VOL_TOTAL).",
        lambda g: g.ecc_uncorrected,
    ),
    (
        "dpserve_gpu_throttle_reasons",
        "NVML clocks-event reasons bitmask (DCGM CLOCK_THROTTLE_REASONS).",
        lambda g: g.throttle_reasons,
    ),
    ("dpserve_gpu_pcie_link_width", "Current PCIe link width (lanes).", lambda g: g.pcie_width),
    ("dpserve_gpu_pcie_link_width_max", "Maximum PCIe link width (lanes).", lambda g: g.pcie_width_max),
    ("dpserve_gpu_pcie_link_gen", "Current PCIe link generation.", lambda g: g.pcie_gen),
    (
        "dpserve_gpu_pages_pending",
        "1 when memory waits for a reset to be remapped or retired.",
        lambda g: None if g.pages_pending is None else float(g.pages_pending),
    ),
)


REPLICA_GAUGES: tuple[tuple[str, str, Callable[[ReplicaGpus], float | None]], ...] = (
    ("dpserve_replica_gpus", "GPUs tied to the replica (its tensor-parallel size, where known).", lambda r: r.gpus),
    (
        "dpserve_replica_gpu_utilization_ratio",
        "The replica's busiest GPU's utilization: its ranks move at that GPU's pace (DCGM GPU_UTIL / 100, max).",
        lambda r: r.utilization_gpu,
    ),
    (
        "dpserve_replica_gpu_memory_used_bytes",
        "Device memory in use on all the replica's GPUs (summed).",
        lambda r: r.memory_used_bytes,
    ),
    (
        "dpserve_replica_gpu_memory_total_bytes",
        "Device memory of all the replica's GPUs (summed).",
        lambda r: r.memory_total_bytes,
    ),
    ("dpserve_replica_gpu_power_watts", "Power draw of all the replica's GPUs (summed).", lambda r: r.power_watts),
)
"""Per replica, its GPUs combined (gpu/combined.py); only where every GPU of it gave the reading."""


class GpuCollector(Collector):
    def __init__(self, fleet: GpuFleet) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[Metric]:
        fleet = self._fleet
        families = [(GaugeMetricFamily(name, doc, labels=LABELS), read) for name, doc, read in GAUGES]
        up = GaugeMetricFamily(
            "dpserve_gpu_up", "1 when the GPU answered its last NVML reading, 0 when not (lost, say).", labels=LABELS
        )
        degraded = GaugeMetricFamily(
            "dpserve_gpu_degraded",
            "1 while the GPU is degraded (throttling, Xid or ECC errors, PCIe link, pages pending).",
            labels=LABELS,
        )
        for device in fleet.devices:
            gpu = device.gpu
            labels = [str(gpu.index), gpu.uuid, device.replica or "", device.host]
            up.add_metric(labels, 1.0 if gpu.readable else 0.0)
            degraded.add_metric(labels, 1.0 if device.verdict.degraded else 0.0)
            for family, read in families:
                value = read(gpu)
                if value is not None:
                    family.add_metric(labels, float(value))
        yield from (family for family, _ in families)
        yield up
        yield degraded
        yield GaugeMetricFamily(
            "dpserve_gpus",
            "GPUs read at the last sample, this host's and the agents' (0 without any).",
            value=len(fleet.devices),
        )
        yield CounterMetricFamily(
            "dpserve_gpu_sampler_failures",
            "Times NVML as a whole failed a reading and was opened again.",
            value=fleet.local.failures if fleet.local is not None else 0,
        )
        degradations = CounterMetricFamily(
            "dpserve_replica_gpu_degradations",
            "Times a replica was soft-drained because its GPU became degraded.",
            labels=["replica"],
        )
        for replica, count in sorted(fleet.degradations.items()):
            degradations.add_metric([replica], count)
        yield degradations
        yield from replica_families(fleet)
        if fleet.agents is not None:
            agents_up = GaugeMetricFamily(
                "dpserve_gpu_agent_up", "1 when the GPU agent's last poll succeeded.", labels=["agent", "host"]
            )
            for agent in fleet.agents.agents.values():
                host = agent.reading.host if agent.reading else ""
                agents_up.add_metric([agent.url, host], 0.0 if agent.error or agent.reading is None else 1.0)
            yield agents_up


def replica_families(fleet: GpuFleet) -> Iterator[Metric]:
    families = [(GaugeMetricFamily(name, doc, labels=["replica"]), read) for name, doc, read in REPLICA_GAUGES]
    for replica, gpus in sorted(fleet.replica_gpus().items()):
        for family, read in families:
            value = read(gpus)
            if value is not None:
                family.add_metric([replica], float(value))
    yield from (family for family, _ in families)
