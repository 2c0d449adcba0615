"""The router's CPU split by part: the monitor's visits and scrapes metered apart, libzmq's threads read
from the kernel, the split in /metrics and summed over workers in /status."""

from __future__ import annotations

import time

import zmq

from dpserve.background import CpuMeter
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.monitor import ReplicaMonitor
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.control.worker_status import combine
from dpserve.router.observe.control_cpu import ControlCpu, ControlCpuCollector, zmq_threads_seconds
from tests.unit.test_cpu_meter import burn
from tests.unit.test_monitor_schedule import ScriptedReplicas


class CostlyReplicas(ScriptedReplicas):
    """Reading /metrics costs the router 30 ms of CPU, any other path 10 ms."""

    async def get(self, base_url: str, path: str) -> tuple[int, bytes]:
        burn(0.03 if path == "/metrics" else 0.01)
        return await super().get(base_url, path)


async def test_a_visits_reads_of_metrics_count_as_scrapes_the_rest_as_probes() -> None:
    registry = ReplicaRegistry(["http://10.0.0.1:8000"])
    cpu = ControlCpu()
    monitor = ReplicaMonitor(
        registry, ModelCatalog(registry), CostlyReplicas(), 1.0, probes_cpu=cpu.probes, scrapes_cpu=cpu.scrapes
    )
    await monitor.probe_all()  # at start: /health, /v1/models and /metrics
    assert 0.028 <= cpu.scrapes.seconds < 0.05 and 0.018 <= cpu.probes.seconds < 0.04, cpu
    cpu.probes.seconds = cpu.scrapes.seconds = 0.0
    monitor._visit(list(registry), 1)  # /health and /metrics (its models were read at start)
    while monitor._tasks:
        await next(iter(monitor._tasks))
    assert 0.028 <= cpu.scrapes.seconds < 0.05, cpu.scrapes.seconds
    assert 0.009 <= cpu.probes.seconds < 0.025, cpu.probes.seconds


def test_libzmq_threads_are_read_from_the_kernel() -> None:
    context = zmq.Context()
    before = zmq_threads_seconds()
    sink, source = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    source.connect(f"tcp://127.0.0.1:{port}")
    payload = b"x" * 512
    started = time.monotonic()
    while zmq_threads_seconds() - before < 0.02:  # libzmq's I/O thread moves every message
        assert time.monotonic() - started < 30, "libzmq's threads never showed any CPU"
        for _ in range(40):
            for _ in range(500):  # under the sockets' high-water marks (1000 each): no send blocks
                source.send(payload)
            for _ in range(500):
                sink.recv()
    source.close(linger=0)
    sink.close(linger=0)
    context.term()


def test_the_split_is_in_metrics_and_summed_over_workers() -> None:
    cpu = ControlCpu(peers=CpuMeter())
    cpu.kv_events.seconds = 1.5
    (family,) = ControlCpuCollector(cpu).collect()
    assert family.name == "dpserve_control_plane_cpu_seconds"
    parts = {sample.labels["part"]: sample.value for sample in family.samples if sample.name.endswith("_total")}
    assert set(parts) == {"probes", "scrapes", "kv_events", "kv_events_io", "peers", "process"}
    assert parts["kv_events"] == 1.5 and parts["process"] > 0
    merged = combine(
        {"replicas": [], "control_plane_cpu_s": {"probes": 1.0, "process": 3.0}},
        [{"replicas": [], "control_plane_cpu_s": {"probes": 0.5, "process": 2.0}}],
    )
    assert merged["control_plane_cpu_s"] == {"probes": 1.5, "process": 5.0}
