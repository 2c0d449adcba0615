"""A replica on several GPUs (tensor parallel, `--replica URL@gpu=0,1`): its GPUs read as one (utilization the
busiest, memory and power summed) in /status and /metrics, and any one of them degraded drains the whole
replica; on this host (NVML, through the fake) and through a GPU agent (compose's index hints)."""

from __future__ import annotations

import dataclasses

import pynvml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dpserve.gpu.combined import combine_gpus
from dpserve.gpu.health import GpuHealthRules, GpuHealthTracker
from dpserve.gpu.placement import ReplicaClue
from dpserve.gpu.sample import GpuSample
from dpserve.gpu.sampler import GpuSampler
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.health import HealthRules
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.fleet.agents import parse_reading
from dpserve.router.fleet.gpu_metrics import GpuCollector
from dpserve.router.fleet.gpus import GpuFleet
from tests.fake_nvml import FakeGpu, FakeNvml, StaticAgents
from tests.unit.selection_fixtures import MODEL, REQUEST, selector

GIB = 1 << 30
SPECS = ["r0=http://127.0.0.1:8100@gpu=0,1", "r1=http://127.0.0.1:8101@gpu=2,3"]


def local_fleet(nvml: FakeNvml) -> tuple[ReplicaRegistry, GpuSampler, GpuFleet]:
    registry = ReplicaRegistry(SPECS, HealthRules())
    sampler = GpuSampler(
        lambda: nvml, 1.0, clues=lambda: [ReplicaClue(r.id, r.gpu_hint) for r in registry], clock=lambda: 0.0
    )
    fleet = GpuFleet(registry, sampler, None, GpuHealthTracker(GpuHealthRules(degrade_after_s=0)), clock=lambda: 0.0)
    return registry, sampler, fleet


def four_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu("GPU-0", util_gpu=90, util_memory=40, memory_used=70 * GIB, power_mw=400_000, temperature=60),
            FakeGpu("GPU-1", util_gpu=30, util_memory=50, memory_used=68 * GIB, power_mw=250_000, temperature=55),
            FakeGpu("GPU-2", util_gpu=10, memory_used=20 * GIB),
            FakeGpu("GPU-3", util_gpu=12, memory_used=21 * GIB),
        ]
    )


def test_a_replicas_gpus_combine_to_its_busiest_utilization_and_summed_memory() -> None:
    registry, sampler, fleet = local_fleet(four_gpus())
    sampler.sample_once()
    fleet.refresh()
    assert [(d.gpu.index, d.replica) for d in fleet.devices] == [(0, "r0"), (1, "r0"), (2, "r1"), (3, "r1")]
    combined = fleet.replica_gpus()
    r0 = combined["r0"]
    assert (r0.gpus, r0.readable) == (2, 2)
    assert r0.utilization_gpu == 0.9  # the busiest rank, not the mean (0.6)
    assert r0.utilization_memory == 0.5
    assert r0.memory_used_bytes == 138 * GIB and r0.memory_total_bytes == 160 * GIB
    assert r0.power_watts == 650.0 and r0.temperature_celsius == 60.0
    assert combined["r1"].utilization_gpu == 0.12 and combined["r1"].memory_used_bytes == 41 * GIB
    assert registry.degraded_ids == frozenset()


def test_one_degraded_gpu_drains_its_whole_replica_and_no_other() -> None:
    nvml = four_gpus()
    registry, sampler, fleet = local_fleet(nvml)
    catalog = ModelCatalog(registry)
    for replica in registry:
        registry.probe_succeeded(replica.id)
        catalog.set_model_cards(replica.id, ({"id": MODEL},))
    router = selector(registry, catalog, "least_loaded", limit=4)
    registry.get("r0").in_flight = 2  # r1 is the less loaded, so the one chosen while it is well
    sampler.sample_once()
    fleet.refresh()
    assert router.decide(REQUEST).id == "r1"
    nvml.gpus[3].throttle_reasons = pynvml.nvmlClocksEventReasonHwSlowdown  # r1's second GPU only
    sampler.sample_once()
    fleet.refresh()
    assert registry.degraded_ids == {"r1"}
    assert registry.get("r1").state == "degraded" and registry.get("r0").state == "healthy"
    assert registry.get("r1").degraded == ("GPU 3: throttled: hw_slowdown",)
    assert {router.decide(REQUEST).id for _ in range(20)} == {"r0"}  # drained, though the less loaded
    nvml.gpus[3].throttle_reasons = 0
    nvml.gpus[2].raise_xid(79)  # fallen off the bus: the other rank of the same replica
    sampler.sample_once()
    fleet.refresh()
    # Both of r1's GPUs now (GPU 3 waits out its recovery stretch); r0 still untouched.
    assert registry.degraded_ids == {"r1"}
    assert [reason.split(":")[0] for reason in registry.get("r1").degraded] == ["GPU 2", "GPU 3"]
    assert "Xid 79" in registry.get("r1").degraded[0]


def test_a_lost_gpu_leaves_the_combined_reading_unknown_not_lighter() -> None:
    nvml = four_gpus()
    _, sampler, fleet = local_fleet(nvml)
    nvml.gpus[1].lost = True
    sampler.sample_once()
    fleet.refresh()
    r0 = fleet.replica_gpus()["r0"]
    assert (r0.gpus, r0.readable) == (2, 1)
    assert r0.utilization_gpu is None and r0.memory_used_bytes is None and r0.power_watts is None
    one = combine_gpus([GpuSample(0, "GPU-a", "H100", utilization_gpu=0.5, memory_used_bytes=GIB)])
    assert (one.utilization_gpu, one.memory_used_bytes) == (0.5, GIB)  # one GPU: its own values
    assert combine_gpus([]).utilization_gpu is None


def test_metrics_export_each_replicas_gpus_combined() -> None:
    _, sampler, fleet = local_fleet(four_gpus())
    sampler.sample_once()
    fleet.refresh()
    prometheus = CollectorRegistry()
    prometheus.register(GpuCollector(fleet))
    text = generate_latest(prometheus).decode()
    values = {
        (sample.name, sample.labels.get("replica")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert values[("dpserve_replica_gpus", "r0")] == 2
    assert values[("dpserve_replica_gpu_utilization_ratio", "r0")] == 0.9
    assert values[("dpserve_replica_gpu_memory_used_bytes", "r0")] == 138 * GIB
    assert values[("dpserve_replica_gpu_memory_total_bytes", "r1")] == 160 * GIB
    assert values[("dpserve_replica_gpu_power_watts", "r0")] == 650.0


def test_an_agents_gpus_are_tied_by_compose_index_hints_and_drain_the_replica() -> None:
    # `dpserve compose --tensor-parallel-size 2`: vllm-0 on GPUs 0,1 and vllm-1 on 2,3, read by the host's agent.
    registry = ReplicaRegistry(["r0=http://vllm-0:8000@gpu=0,1", "r1=http://vllm-1:8000@gpu=2,3"], HealthRules())
    gpus = [GpuSample(i, f"GPU-{i}", "H100", utilization_gpu=0.1 * (i + 1), memory_used_bytes=GIB) for i in range(4)]
    reading = parse_reading({"host": "gpu-host", "gpus": [gpu.to_dict() for gpu in gpus]})

    class State:
        url = "http://gpu-agent:9400"

    agents = StaticAgents([(State(), reading)])
    tracker = GpuHealthTracker(GpuHealthRules(degrade_after_s=0))
    fleet = GpuFleet(registry, None, agents, tracker, clock=lambda: 0.0)  # type: ignore[arg-type]
    fleet.refresh()
    assert [d.replica for d in fleet.devices] == ["r0", "r0", "r1", "r1"]
    assert fleet.replica_gpus()["r1"].utilization_gpu == 0.4
    assert fleet.replica_gpus()["r1"].memory_used_bytes == 2 * GIB
    hot = dataclasses.replace(reading.gpus[1], ecc_uncorrected=0, pages_pending=True)
    agents._readings = [(State(), dataclasses.replace(reading, gpus=(reading.gpus[0], hot, *reading.gpus[2:])))]
    fleet.refresh()
    assert registry.degraded_ids == {"r0"}
    assert registry.get("r0").degraded[0].startswith("GPU 1 on gpu-host: ")
