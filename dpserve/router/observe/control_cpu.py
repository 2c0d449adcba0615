"""Where the router's CPU goes besides requests: each background part's own meter (`CpuMeter`), libzmq's
threads (the KV-event streams' sockets) as the kernel counts them, and the whole process's. Read by /status
and /metrics; `dpserve bench scale` prints the split of an idle router at 1024 replicas."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.background import CpuMeter

TASKS = Path("/proc/self/task")
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ControlCpu:
    probes: CpuMeter = field(default_factory=CpuMeter)
    """Health probes and their schedule (reading /health and /v1/models)."""
    scrapes: CpuMeter = field(default_factory=CpuMeter)
    """Reading and parsing replicas' /metrics."""
    kv_events: CpuMeter = field(default_factory=CpuMeter)
    """Reading, decoding and indexing KV-event batches on the event loop."""
    peers: CpuMeter = field(default_factory=CpuMeter)

    def seconds(self) -> dict[str, float]:
        """CPU seconds since start by part; `kv_events_io`: libzmq's own threads; `process`: all of it."""
        return {
            "probes": self.probes.seconds,
            "scrapes": self.scrapes.seconds,
            "kv_events": self.kv_events.seconds,
            "kv_events_io": zmq_threads_seconds(),
            "peers": self.peers.seconds,
            "process": time.process_time(),
        }


def zmq_threads_seconds() -> float:
    """User + system CPU of this process's libzmq threads (named ZMQbg/...), 0 where /proc does not say."""
    total = 0
    try:
        tasks = list(TASKS.iterdir())
    except OSError:
        return 0.0
    for task in tasks:
        try:
            if not (task / "comm").read_text().startswith("ZMQbg"):
                continue
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return total / TICKS_PER_S


class ControlCpuCollector(Collector):
    def __init__(self, cpu: ControlCpu) -> None:
        self._cpu = cpu

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "dpserve_control_plane_cpu_seconds",
            "CPU seconds the router spent on each background part (kv_events_io: libzmq's threads; process: "
            "the whole router, requests included).",
            labels=["part"],
        )
        for part, seconds in self._cpu.seconds().items():
            family.add_metric([part], seconds)
        yield family
