"""GPU health: what NVML says (read through a fake at the NVML boundary that raises pynvml's own errors),
how each condition degrades a GPU and how it comes back (hysteresis), and what selection does with a
replica on a degraded GPU."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pynvml
import pytest

from dpserve.config import RouterSettings
from dpserve.gpu.health import GpuHealthRules, GpuHealthTracker, throttle_mask, throttle_names
from dpserve.gpu.nvml import MAX_EVENTS_PER_READ, NvmlReader
from dpserve.gpu.sample import GpuProcess, GpuSample
from dpserve.replicas.health import HealthRules
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.fleet.agents import AgentReadingError, parse_reading
from dpserve.router.fleet.gpus import GpuFleet
from dpserve.router.parts import gpu_health_rules
from tests.fake_nvml import FakeGpu, FakeNvml, StaticAgents
from tests.unit.selection_fixtures import REQUEST, fleet, selector


def read(nvml: FakeNvml) -> tuple[GpuSample, ...]:
    reader = NvmlReader(nvml)
    reader.open()
    return reader.read()


# -- At the NVML boundary ------------------------------------------------------------------------------


def test_health_fields_are_read_in_nvml_terms() -> None:
    gpu = FakeGpu("GPU-a", ecc_uncorrected=3, throttle_reasons=pynvml.nvmlClocksEventReasonHwSlowdown)
    gpu.pcie_width, gpu.pcie_gen = 8, 4
    (sample,) = read(FakeNvml([gpu]))
    assert sample.ecc_uncorrected == 3
    assert sample.throttle_reasons == 0x8 and throttle_names(sample.throttle_reasons) == ("hw_slowdown",)
    assert (sample.pcie_gen, sample.pcie_gen_max, sample.pcie_width, sample.pcie_width_max) == (4, 5, 8, 16)
    assert sample.pages_pending is False
    assert sample.xid_errors == 0 and sample.last_xid is None


def test_throttle_bits_are_pynvmls() -> None:
    assert throttle_mask(("hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")) == (
        pynvml.nvmlClocksEventReasonHwSlowdown
        | pynvml.nvmlClocksEventReasonSwThermalSlowdown
        | pynvml.nvmlClocksEventReasonHwThermalSlowdown
        | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    )
    assert throttle_mask(("sw_power_cap",)) == pynvml.nvmlClocksEventReasonSwPowerCap
    with pytest.raises(ValueError, match="unknown throttle reason"):
        throttle_mask(("too_hot",))


def test_xid_events_are_counted_across_readings_and_the_event_set_is_freed() -> None:
    nvml = FakeNvml([FakeGpu("GPU-a"), FakeGpu("GPU-b")])
    reader = NvmlReader(nvml)
    reader.open()
    assert [s.xid_errors for s in reader.read()] == [0, 0]
    nvml.gpus[1].raise_xid(79)
    nvml.gpus[1].raise_xid(48)
    first, second = reader.read()
    assert (first.xid_errors, first.last_xid) == (0, None)
    assert (second.xid_errors, second.last_xid) == (2, 48)
    nvml.gpus[1].raise_xid(63)
    assert reader.read()[1].xid_errors == 3
    reader.close()
    assert nvml.freed_event_sets == len(nvml.event_sets) == 2


def test_a_flood_of_xids_is_drained_a_bounded_amount_per_reading() -> None:
    nvml = FakeNvml([FakeGpu("GPU-a", xid_queue=[31] * (MAX_EVENTS_PER_READ + 10))])
    reader = NvmlReader(nvml)
    reader.open()
    assert reader.read()[0].xid_errors == MAX_EVENTS_PER_READ
    assert reader.read()[0].xid_errors == MAX_EVENTS_PER_READ + 10


@pytest.mark.parametrize(
    ("pending", "failed", "retired", "expected"),
    [(False, False, False, False), (True, False, False, True), (False, True, False, True)],
)
def test_remapped_rows_pending_or_failed(pending: bool, failed: bool, retired: bool, expected: bool) -> None:
    (sample,) = read(FakeNvml([FakeGpu("GPU-a", remap_pending=pending, remap_failed=failed, retired_pending=retired)]))
    assert sample.pages_pending is expected


def test_boards_without_row_remapping_report_page_retirement() -> None:
    gpu = FakeGpu("GPU-a", unsupported={"remap"}, retired_pending=True)
    assert read(FakeNvml([gpu]))[0].pages_pending is True
    gpu.unsupported.add("retired")
    assert read(FakeNvml([gpu]))[0].pages_pending is None


@pytest.mark.parametrize(
    "error", [pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_NoPermission]
)
def test_health_readings_a_gpu_or_driver_lacks_are_none(error: type[pynvml.NVMLError], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    nvml = FakeNvml([FakeGpu("GPU-a", power_mw=90_000)])

    def refuse(*_: object) -> None:
        raise error()

    for call in (
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrPcieLinkWidth",
        "nvmlDeviceGetMaxPcieLinkGeneration",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceRegisterEvents",
    ):
        monkeypatch.setattr(nvml, call, refuse)
    (sample,) = read(nvml)
    assert sample.readable and sample.power_watts == 90.0
    assert sample.ecc_uncorrected is None and sample.throttle_reasons is None
    assert sample.pcie_width is None and sample.pcie_gen_max is None and sample.pcie_gen == 5
    assert sample.pages_pending is None and sample.xid_errors is None


def test_a_lost_gpu_is_unreadable_not_unhealthy_by_itself() -> None:
    tracker = GpuHealthTracker(GpuHealthRules(degrade_after_s=0))
    lost = GpuSample(0, "GPU-a", "H100", error=str(pynvml.NVMLError_GpuIsLost()))
    assert tracker.update("GPU-a", lost, 0).degraded is False


# -- Conditions and hysteresis ---------------------------------------------------------------------------

RULES = GpuHealthRules(event_hold_s=60, degrade_after_s=2, recover_after_s=10)
OK = GpuSample(0, "GPU-a", "H100", utilization_gpu=0.9, xid_errors=0, ecc_uncorrected=0, throttle_reasons=0)
OK = dataclasses.replace(OK, pcie_gen=5, pcie_gen_max=5, pcie_width=16, pcie_width_max=16, pages_pending=False)


def steps(tracker: GpuHealthTracker, sample: GpuSample, start: float, end: float, step: float = 1.0) -> list[bool]:
    out, now = [], start
    while now <= end:
        out.append(tracker.update("GPU-a", sample, now).degraded)
        now += step
    return out


def test_a_new_xid_degrades_at_once_and_is_held_then_recovers() -> None:
    tracker = GpuHealthTracker(RULES)
    assert tracker.update("GPU-a", OK, 0).degraded is False
    verdict = tracker.update("GPU-a", dataclasses.replace(OK, xid_errors=1, last_xid=79), 1)
    assert verdict.degraded and verdict.reasons == ("Xid 79",) and verdict.since == 1
    still = dataclasses.replace(OK, xid_errors=1, last_xid=79)
    assert all(steps(tracker, still, 2, 60))  # held event_hold_s after the event
    assert tracker.update("GPU-a", still, 62).recovering  # then recovering for recover_after_s
    assert tracker.update("GPU-a", still, 71).degraded
    assert tracker.update("GPU-a", still, 72).degraded is False


def test_xids_an_application_raises_do_not_degrade() -> None:
    tracker = GpuHealthTracker(RULES)
    tracker.update("GPU-a", OK, 0)
    assert tracker.update("GPU-a", dataclasses.replace(OK, xid_errors=1, last_xid=13), 1).degraded is False
    assert tracker.update("GPU-a", dataclasses.replace(OK, xid_errors=2, last_xid=43), 2).degraded is False


def test_errors_from_before_the_first_reading_are_the_baseline() -> None:
    tracker = GpuHealthTracker(RULES)
    earlier = dataclasses.replace(OK, ecc_uncorrected=7, xid_errors=2, last_xid=79)
    assert tracker.update("GPU-a", earlier, 0).degraded is False
    verdict = tracker.update("GPU-a", dataclasses.replace(OK, ecc_uncorrected=9, xid_errors=2), 1)
    assert verdict.degraded and verdict.reasons == ("2 uncorrected ECC error(s)",)


def test_throttling_must_last_before_it_degrades_and_a_blip_does_not() -> None:
    tracker = GpuHealthTracker(RULES)
    hot = dataclasses.replace(OK, throttle_reasons=pynvml.nvmlClocksEventReasonHwThermalSlowdown)
    assert tracker.update("GPU-a", hot, 0).degraded is False
    assert tracker.update("GPU-a", OK, 1).degraded is False  # a blip
    assert steps(tracker, hot, 2, 5) == [False, False, True, True]
    assert tracker.update("GPU-a", hot, 5).reasons == ("throttled: hw_thermal",)


def test_power_capping_at_full_load_is_normal_by_default_and_a_rule_can_count_it() -> None:
    capped = dataclasses.replace(OK, throttle_reasons=pynvml.nvmlClocksEventReasonSwPowerCap | 0x1)
    assert not any(steps(GpuHealthTracker(RULES), capped, 0, 10))
    strict = dataclasses.replace(RULES, throttle=("sw_power_cap",))
    assert steps(GpuHealthTracker(strict), capped, 0, 3)[-1] is True


def test_pcie_width_below_max_counts_and_generation_only_while_busy() -> None:
    narrow = dataclasses.replace(OK, pcie_width=8, utilization_gpu=0.0)
    assert steps(GpuHealthTracker(RULES), narrow, 0, 3)[-1] is True
    slow_idle = dataclasses.replace(OK, pcie_gen=1, utilization_gpu=0.1)
    assert not any(steps(GpuHealthTracker(RULES), slow_idle, 0, 5))
    slow_busy = dataclasses.replace(OK, pcie_gen=3, utilization_gpu=0.9)
    tracker = GpuHealthTracker(RULES)
    assert steps(tracker, slow_busy, 0, 3)[-1] is True
    assert tracker.update("GPU-a", slow_busy, 4).reasons == ("PCIe link gen3 of gen5 while busy",)


def test_pages_pending_degrade_at_once_and_for_as_long_as_they_wait() -> None:
    tracker = GpuHealthTracker(RULES)
    pending = dataclasses.replace(OK, pages_pending=True)
    assert tracker.update("GPU-a", pending, 0).degraded
    assert steps(tracker, pending, 1, 100, 10.0) == [True] * 10


def test_recovery_waits_for_a_clear_stretch_and_restarts_when_the_condition_returns() -> None:
    tracker = GpuHealthTracker(RULES)
    hot = dataclasses.replace(OK, throttle_reasons=pynvml.nvmlClocksEventReasonHwSlowdown)
    assert steps(tracker, hot, 0, 2)[-1] is True
    assert all(steps(tracker, OK, 3, 11))  # 9 s clear: still degraded, recovering
    assert tracker.update("GPU-a", OK, 11).recovering
    assert tracker.update("GPU-a", hot, 12).degraded  # back: the clear stretch starts over
    assert all(steps(tracker, OK, 13, 22))
    assert tracker.update("GPU-a", OK, 23).degraded is False


def test_the_router_settings_defaults_are_the_rules_defaults() -> None:
    assert gpu_health_rules(RouterSettings()) == GpuHealthRules()


def test_bad_health_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="throttle reason"):
        gpu_health_rules(RouterSettings(gpu_throttle_reasons=("hot",)))
    with pytest.raises(ValueError):
        gpu_health_rules(RouterSettings(gpu_ignored_xids=("x",)))
    with pytest.raises(ValueError, match="recover_after_s"):
        gpu_health_rules(RouterSettings(gpu_recover_after_s=-1))


# -- Selection ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sample", [0, 2])
def test_a_degraded_replica_gets_no_new_requests_while_another_has_room(sample: int) -> None:
    registry, catalog = fleet(3)
    registry.get("r0").in_flight = 0
    registry.get("r1").in_flight = 2
    registry.get("r2").in_flight = 3
    router = selector(registry, catalog, "least_loaded", sample=sample, limit=4)
    assert router.decide(REQUEST).id == "r0"
    assert registry.set_degraded("r0", ("GPU 0: throttled: hw_thermal",)) is True
    assert registry.get("r0").state == "degraded"
    assert Counter(router.decide(REQUEST).id for _ in range(30)).keys() <= {"r1", "r2"}
    registry.get("r1").in_flight = registry.get("r2").in_flight = 4  # the others are full
    assert router.decide(REQUEST).id == "r0"  # a degraded replica beats a refusal
    registry.get("r1").in_flight = 1
    assert router.decide(REQUEST).id == "r1"
    assert registry.set_degraded("r0", ()) is True
    assert router.decide(REQUEST).id == "r0"


def test_the_last_replica_is_never_drained_for_its_gpu() -> None:
    registry, catalog = fleet(2)
    registry.set_degraded("r0", ("GPU 0: Xid 79",))
    registry.set_degraded("r1", ("GPU 1: Xid 79",))
    router = selector(registry, catalog, "least_loaded", limit=4)
    assert {router.decide(REQUEST).id for _ in range(20)} == {"r0", "r1"}
    registry.remove("r1")
    assert router.decide(REQUEST).id == "r0"


def test_clearing_a_degraded_replica_wakes_waiting_requests() -> None:
    registry, _ = fleet(1)
    woken: list[int] = []
    registry.on_change(lambda: woken.append(1))
    registry.set_degraded("r0", ("x",))
    assert woken == []
    registry.set_degraded("r0", ())
    assert woken == [1]


# -- A remote GPU tied to its replica -------------------------------------------------------------------


def test_agent_gpus_are_tied_to_replicas_by_listening_address_and_degrade_them() -> None:
    registry = ReplicaRegistry(["r0=http://127.0.0.2:8000", "r1=http://127.0.0.3:8000"], HealthRules())
    hot = pynvml.nvmlClocksEventReasonHwSlowdown
    payload = {
        "host": "node-a",
        "gpus": [
            GpuSample(0, "GPU-x", "H100", processes=(GpuProcess(7, None, ("127.0.0.3:8000",)),)).to_dict(),
            GpuSample(
                1, "GPU-y", "H100", throttle_reasons=hot, processes=(GpuProcess(8, None, ("0.0.0.0:22",)),)
            ).to_dict(),
        ],
    }
    reading = parse_reading(payload)

    class State:
        url = "http://127.0.0.2:9400"

    agents = StaticAgents([(State(), reading)])
    clock = [0.0]
    fleet_view = GpuFleet(
        registry,
        None,
        agents,  # type: ignore[arg-type]
        GpuHealthTracker(GpuHealthRules(degrade_after_s=0)),
        clock=lambda: clock[0],
    )
    fleet_view.refresh()
    assert [(d.host, d.gpu.uuid, d.replica) for d in fleet_view.devices] == [
        ("node-a", "GPU-x", "r1"),
        ("node-a", "GPU-y", None),
    ]
    assert registry.degraded_ids == frozenset()  # the hot GPU serves no replica
    hot_x = dataclasses.replace(reading.gpus[0], throttle_reasons=hot)
    agents._readings = [(State(), dataclasses.replace(reading, gpus=(hot_x,)))]
    fleet_view.refresh()
    assert registry.degraded_ids == {"r1"}
    assert registry.get("r1").degraded == ("GPU 0 on node-a: throttled: hw_slowdown",)
    assert fleet_view.degradations == {"r1": 1}


def test_a_malformed_agent_reading_is_refused_with_a_reason() -> None:
    with pytest.raises(AgentReadingError, match="gpus"):
        parse_reading({"host": "x"})
    with pytest.raises(AgentReadingError, match="malformed"):
        parse_reading({"gpus": [{"index": "zero"}]})
    reading = parse_reading({"host": "h", "gpus": [], "unavailable": "no NVIDIA GPU found"})
    assert reading.unavailable == "no NVIDIA GPU found" and reading.gpus == ()


def test_an_index_hint_names_a_remote_gpu_only_where_one_host_is_read() -> None:
    registry = ReplicaRegistry(["r0=http://vllm-0:8000@gpu=1", "r1=http://vllm-1:8000@gpu=GPU-b0"], HealthRules())
    one_host = parse_reading({"host": "a", "gpus": [GpuSample(i, f"GPU-a{i}", "H100").to_dict() for i in range(2)]})
    other = parse_reading({"host": "b", "gpus": [GpuSample(0, "GPU-b0", "H100").to_dict()]})

    class State:
        def __init__(self, url: str) -> None:
            self.url = url

    def placed(readings: list[tuple[object, object]]) -> dict[str, str | None]:
        view = GpuFleet(registry, None, StaticAgents(readings), GpuHealthTracker())  # type: ignore[arg-type]
        view.refresh()
        return {device.gpu.uuid: device.replica for device in view.devices}

    assert placed([(State("http://a:9400"), one_host)]) == {"GPU-a0": None, "GPU-a1": "r0"}
    both = placed([(State("http://a:9400"), one_host), (State("http://b:9400"), other)])
    assert both == {"GPU-a0": None, "GPU-a1": None, "GPU-b0": "r1"}  # which host's GPU 1? none is guessed
