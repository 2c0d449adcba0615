"""The agent's /metrics: every GPU's reading under the names NVIDIA's DCGM exporter uses, in its units
and with its labels, so dashboards and alerts written for dcgm-exporter read a dpserve agent as well."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.agent.reading import first_owner
from dpserve.gpu.sample import GpuSample, GpuSnapshot

LABELS = ["gpu", "UUID", "device", "modelName", "Hostname", "container", "pod"]
MIB = 1 << 20


def _percent(value: float | None) -> float | None:
    return None if value is None else value * 100.0


def _mib(value: int | None) -> float | None:
    return None if value is None else value / MIB


def _free_mib(gpu: GpuSample) -> float | None:
    if gpu.memory_total_bytes is None or gpu.memory_used_bytes is None:
        return None
    return (gpu.memory_total_bytes - gpu.memory_used_bytes) / MIB


# (DCGM field name, help as DCGM's default counters file has it, how to read it off a sample)
FIELDS: tuple[tuple[str, str, Callable[[GpuSample], float | None]], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda g: _percent(g.utilization_gpu)),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", lambda g: _percent(g.utilization_memory)),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda g: _mib(g.memory_used_bytes)),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", _free_mib),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda g: g.power_watts),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda g: g.temperature_celsius),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", lambda g: g.sm_clock_mhz),
    (
        "DCGM_FI_DEV_XID_ERRORS",
        "Value of the last XID error encountered (0: none since the agent started).",
        lambda g: None if g.xid_errors is None else float(g.last_xid or 0),
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "Total number of double-bit volatile ECC errors.",
        lambda g: g.ecc_uncorrected,
    ),
    (
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        "Current clock throttle reasons (NVML clocks-event reasons bitmask).",
        lambda g: g.throttle_reasons,
    ),
    ("DCGM_FI_DEV_PCIE_LINK_GEN", "PCIe current link generation.", lambda g: g.pcie_gen),
    ("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "PCIe max link generation.", lambda g: g.pcie_gen_max),
    ("DCGM_FI_DEV_PCIE_LINK_WIDTH", "PCIe current link width.", lambda g: g.pcie_width),
    ("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "PCIe max link width.", lambda g: g.pcie_width_max),
    (
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "Pending row remapping, or pending page retirement on boards without remapping (1: a reset is due).",
        lambda g: None if g.pages_pending is None else float(g.pages_pending),
    ),
    (
        "dpserve_agent_xid_errors",
        "Xid errors seen since the agent started (DCGM reports only the last one's code).",
        lambda g: g.xid_errors,
    ),
    (
        "dpserve_agent_gpu_readable",
        "1 when the GPU answered the last reading, 0 when it did not (lost, say).",
        lambda g: 1.0 if g.readable else 0.0,
    ),
)


class AgentCollector(Collector):
    """Reads the agent's latest snapshot at scrape time; a field a GPU does not report is left out."""

    def __init__(self, snapshot: Callable[[], GpuSnapshot], hostname: str) -> None:
        self._snapshot = snapshot
        self._hostname = hostname

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        families = {name: GaugeMetricFamily(name, text, labels=LABELS) for name, text, _ in FIELDS}
        for gpu in snapshot.gpus:
            owner = first_owner(gpu)
            labels = [
                str(gpu.index),
                gpu.uuid,
                f"nvidia{gpu.index}",
                gpu.name,
                self._hostname,
                (owner.container or "") if owner else "",
                (owner.pod or "") if owner else "",
            ]
            for name, _, read in FIELDS:
                value = read(gpu)
                if value is not None:
                    families[name].add_metric(labels, float(value))
        yield from families.values()
        up = GaugeMetricFamily("dpserve_agent_nvml_up", "1 when NVML could be read at the last reading.")
        up.add_metric([], 0.0 if snapshot.unavailable else 1.0)
        yield up
