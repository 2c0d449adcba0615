"""The NVML sampler, GPU placement and `dpserve gpus`, against a fake at the NVML boundary."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections.abc import Callable

import pynvml
import pytest

from dpserve.gpu.local_processes import ReplicaProcesses
from dpserve.gpu.nvml import NvmlReader, NvmlUnavailable, count_nvidia_gpus
from dpserve.gpu.placement import ReplicaClue, parse_replica_spec, place_replicas
from dpserve.gpu.sample import GpuProcess, GpuSample
from dpserve.gpu.sampler import GpuSampler
from dpserve.gpu.table import describe_process, format_gpus, print_gpus
from dpserve.replicas.registry import ReplicaRegistry
from tests.conftest import free_port
from tests.fake_nvml import FakeGpu, FakeNvml, two_gpus


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_reader_converts_nvml_units() -> None:
    reader = NvmlReader(two_gpus())
    reader.open()
    first, second = reader.read()
    assert (first.index, first.uuid, first.name) == (0, "GPU-aaaa", "NVIDIA H100 80GB HBM3")
    assert first.utilization_gpu == pytest.approx(0.87)
    assert first.utilization_memory == pytest.approx(0.41)
    assert (first.memory_used_bytes, first.memory_total_bytes) == (60 << 30, 80 << 30)
    assert first.power_watts == pytest.approx(70.0)
    assert first.power_limit_watts == pytest.approx(700.0)
    assert first.temperature_celsius == 35.0
    assert first.sm_clock_mhz == 1980
    assert first.processes == (GpuProcess(4242, 59 << 30),)
    assert first.readable and first.error is None
    assert second.power_watts == pytest.approx(95.5)
    assert second.processes == ()


def test_unsupported_readings_are_none_and_the_rest_is_read() -> None:
    nvml = FakeNvml([FakeGpu("GPU-x", unsupported={"power", "power_limit", "clock"}, processes=[(7, None)])])
    reader = NvmlReader(nvml)
    reader.open()
    (gpu,) = reader.read()
    assert gpu.readable
    assert (gpu.power_watts, gpu.power_limit_watts, gpu.sm_clock_mhz) == (None, None, None)
    assert gpu.temperature_celsius == 35.0
    assert gpu.processes == (GpuProcess(7, None),)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (pynvml.NVMLError_LibraryNotFound(), "no NVIDIA GPU found: NVML Shared Library Not Found"),
        (pynvml.NVMLError_DriverNotLoaded(), "no NVIDIA GPU found: Driver Not Loaded"),
    ],
)
def test_open_without_library_or_driver_is_one_clear_line(error: Exception, expected: str) -> None:
    nvml = two_gpus()
    nvml.init_error = error
    with pytest.raises(NvmlUnavailable, match=f"^{expected}$"):
        NvmlReader(nvml).open()


def test_zero_devices_is_no_gpu_and_nvml_is_shut_down() -> None:
    nvml = FakeNvml([])
    with pytest.raises(NvmlUnavailable, match=r"^no NVIDIA GPU found: NVML reports 0 devices$"):
        NvmlReader(nvml).open()
    assert nvml.shutdowns == 1
    assert count_nvidia_gpus(lambda: nvml) == (0, "no NVIDIA GPU found: NVML reports 0 devices")
    assert count_nvidia_gpus(two_gpus) == (2, None)


def test_gpu_lost_mid_run_marks_that_gpu_and_keeps_reading_the_others(caplog: pytest.LogCaptureFixture) -> None:
    nvml = two_gpus()
    clock = Clock()
    sampler = GpuSampler(lambda: nvml, 1.0, clock=clock)
    before = sampler.sample_once()
    assert [g.readable for g in before.gpus] == [True, True]

    nvml.gpus[1].lost = True
    with caplog.at_level(logging.WARNING, logger="dpserve.gpu"):
        during = sampler.sample_once()
        sampler.sample_once()
    lost = during.gpus[1]
    assert not lost.readable and lost.error == "GPU is lost"
    # Still named: the UUID and name were read before it was lost.
    assert (lost.uuid, lost.name) == ("GPU-aaaa".replace("a", "b"), "NVIDIA H100 80GB HBM3")
    assert lost.utilization_gpu is None and lost.memory_used_bytes is None
    assert during.gpus[0].readable and during.gpus[0].utilization_gpu == pytest.approx(0.87)
    assert during.unavailable is None
    # One warning for the loss, not one per tick.
    assert [r.getMessage() for r in caplog.records] == ["GPU 1 (GPU-bbbb) cannot be read: GPU is lost"]

    nvml.gpus[1].lost = False
    after = sampler.sample_once()
    assert [g.readable for g in after.gpus] == [True, True]
    assert sampler.failures == 0


def test_gpu_lost_from_the_first_reading_is_still_listed() -> None:
    nvml = two_gpus()
    nvml.gpus[0].lost = True
    snapshot = GpuSampler(lambda: nvml, 1.0).sample_once()
    assert [(g.index, g.readable, g.uuid) for g in snapshot.gpus] == [(0, False, ""), (1, True, "GPU-bbbb")]


def test_nvml_failing_as_a_whole_is_reported_then_reopened() -> None:
    nvml = two_gpus()
    sampler = GpuSampler(lambda: nvml, 1.0, clock=Clock())
    sampler.sample_once()
    nvml.driver_error = pynvml.NVMLError_Unknown()
    failed = sampler.sample_once()
    assert failed.gpus == () and failed.unavailable == "NVML failed: Unknown Error"
    assert sampler.failures == 1 and nvml.shutdowns == 1

    nvml.driver_error = None
    recovered = sampler.sample_once()
    assert len(recovered.gpus) == 2 and recovered.unavailable is None
    assert nvml.inits == 2


def test_no_library_is_retried_only_after_the_reopen_delay(caplog: pytest.LogCaptureFixture) -> None:
    nvml = two_gpus()
    nvml.init_error = pynvml.NVMLError_LibraryNotFound()
    clock = Clock()
    sampler = GpuSampler(lambda: nvml, 1.0, reopen_after_s=30.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="dpserve.gpu"):
        for _ in range(5):
            snapshot = sampler.sample_once()
            clock.now += 1
    assert snapshot.unavailable == "no NVIDIA GPU found: NVML Shared Library Not Found"
    assert nvml.inits == 1
    assert [r.getMessage() for r in caplog.records] == ["no NVIDIA GPU found: NVML Shared Library Not Found"]
    nvml.init_error = None
    clock.now += 30
    assert len(sampler.sample_once().gpus) == 2


def test_missing_python_library_is_no_gpu() -> None:
    def missing() -> FakeNvml:
        raise ImportError("No module named 'pynvml'")

    snapshot = GpuSampler(missing, 1.0).sample_once()
    assert snapshot.unavailable is not None
    assert snapshot.unavailable.startswith("no NVIDIA GPU found: nvidia-ml-py is not installed")


def test_placement_failure_does_not_stop_sampling() -> None:
    def broken_clues() -> list[ReplicaClue]:
        raise RuntimeError("psutil exploded")

    snapshot = GpuSampler(two_gpus, 1.0, clues=broken_clues).sample_once()
    assert len(snapshot.gpus) == 2 and snapshot.replica_gpus == {}


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Waits, without blocking the loop, until `condition` holds (a failure past `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_sampling_runs_off_the_event_loop() -> None:
    """A driver that takes 200 ms per call (2.8 s per reading) must not hold up other coroutines: on the loop,
    every call would stall it 200 ms; the bound, 150 ms, leaves a loaded machine's scheduling its slack."""
    nvml = two_gpus()
    sampler = GpuSampler(lambda: nvml, 0.01)
    sampler.start()
    await asyncio.sleep(0)  # let the sampler's task start its first (slow) reading
    nvml.call_delay_s = 0.2
    worst_lag = 0.0
    for _ in range(50):
        started = time.perf_counter()
        await asyncio.sleep(0.01)
        worst_lag = max(worst_lag, time.perf_counter() - started - 0.01)
    nvml.call_delay_s = 0.0
    await sampler.stop()
    assert worst_lag < 0.15, f"the event loop stalled {worst_lag * 1000:.0f} ms"
    assert len(sampler.snapshot.gpus) == 2
    assert nvml.shutdowns == 1


async def test_without_nvml_the_sampler_wakes_only_to_open_it_again() -> None:
    """No GPU on the host: nothing to read until NVML is opened again (every `reopen_after_s`), so no wake-up
    and no rebuild of the router's GPU view every interval (at 1024 replicas a rebuild walks them all)."""
    opened, rebuilt = [0], [0]

    def no_nvml() -> FakeNvml:
        opened[0] += 1
        raise NvmlUnavailable("no NVIDIA GPU found: NVML Shared Library Not Found")

    sampler = GpuSampler(no_nvml, 0.01, reopen_after_s=0.5)
    sampler.on_sample = lambda: rebuilt.__setitem__(0, rebuilt[0] + 1)
    sampler.start()
    await asyncio.sleep(0.3)
    assert opened == [1] and rebuilt == [1], (opened, rebuilt)  # every interval: about 30 of each
    await until(lambda: opened[0] == 2, timeout_s=2.0)
    await sampler.stop()
    assert sampler.snapshot.unavailable.startswith("no NVIDIA GPU found")


async def test_sampler_task_survives_gpu_loss_and_driver_failure() -> None:
    nvml = two_gpus()
    sampler = GpuSampler(lambda: nvml, 0.01, reopen_after_s=0.02)
    sampler.start()
    await until(lambda: len(sampler.snapshot.gpus) == 2)
    nvml.gpus[0].lost = True
    await until(lambda: not sampler.snapshot.gpus[0].readable)
    nvml.driver_error = pynvml.NVMLError_Unknown()
    await until(lambda: sampler.snapshot.gpus == ())
    # First "NVML failed", then reopening fails too until the driver is back.
    assert sampler.snapshot.unavailable in {"NVML failed: Unknown Error", "no NVIDIA GPU found: Unknown Error"}
    assert sampler.failures == 1
    nvml.driver_error = None
    nvml.gpus[0].lost = False
    await until(lambda: [g.readable for g in sampler.snapshot.gpus] == [True, True])
    await sampler.stop()


def sample(index: int, uuid: str, pids: tuple[int, ...] = ()) -> GpuSample:
    return GpuSample(index=index, uuid=uuid, name="g", processes=tuple(GpuProcess(p, None) for p in pids))


def test_placement_by_hint_index_or_uuid_and_by_process() -> None:
    gpus = [sample(0, "GPU-a", (11,)), sample(1, "GPU-b", (22, 23)), sample(2, "GPU-c", (33,))]
    clues = [
        ReplicaClue("r0", hint=("1",)),
        ReplicaClue("r1", hint=("GPU-c",)),
        ReplicaClue("r2", pids=frozenset({10, 11})),
        ReplicaClue("r3", pids=frozenset({99})),  # on this host but on no GPU
        ReplicaClue("r4", hint=("7",)),  # a GPU this host does not have
        ReplicaClue("r5", hint=("0",), pids=frozenset({22})),  # the hint wins
    ]
    assert place_replicas(clues, gpus) == {"r0": (1,), "r1": (2,), "r2": (0,), "r5": (0,)}


def test_placement_of_a_replica_spanning_gpus() -> None:
    gpus = [sample(0, "GPU-a", (5,)), sample(1, "GPU-b", (6,))]
    assert place_replicas([ReplicaClue("r0", pids=frozenset({5, 6}))], gpus) == {"r0": (0, 1)}
    assert place_replicas([ReplicaClue("r0", hint=("0", "1"))], gpus) == {"r0": (0, 1)}


def test_replica_spec_with_gpu_hint() -> None:
    assert parse_replica_spec("http://10.0.0.2:8000/") == ("http://10.0.0.2:8000", ())
    assert parse_replica_spec("http://10.0.0.2:8000@gpu=1") == ("http://10.0.0.2:8000", ("1",))
    assert parse_replica_spec("http://h:1@gpu=GPU-ab12,3") == ("http://h:1", ("GPU-ab12", "3"))
    with pytest.raises(ValueError, match="needs a GPU index or UUID"):
        parse_replica_spec("http://h:1@gpu=")
    registry = ReplicaRegistry(["r0=http://a:1@gpu=0", "r1=http://b:2"])
    assert [(r.url, r.gpu_hint) for r in registry] == [("http://a:1", ("0",)), ("http://b:2", ())]
    assert registry.by_url("http://a:1") is registry.get("r0")


def test_gpus_table_names_each_gpu_and_its_processes(capsys: pytest.CaptureFixture[str]) -> None:
    nvml = two_gpus()
    nvml.gpus[1].lost = True
    assert print_gpus(load=lambda: nvml) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["GPU", "name", "util"]
    assert "87 %" in lines[1] and "60.0 / 80.0 GiB" in lines[1] and "70 W / 700 W" in lines[1]
    assert "1980 MHz" in lines[1] and "35 C" in lines[1]
    assert "cannot be read:" in lines[2] and "GPU is lost" in lines[2]
    assert "GPU 0  GPU-aaaa" in out
    assert any(line.strip().startswith("pid    4242   59.0 GiB") for line in lines)


def test_gpus_table_without_a_gpu_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    nvml = two_gpus()
    nvml.init_error = pynvml.NVMLError_LibraryNotFound()
    assert print_gpus(load=lambda: nvml) == 1
    assert capsys.readouterr().out == "no NVIDIA GPU found: NVML Shared Library Not Found\n"


def test_format_gpus_describes_processes() -> None:
    text = format_gpus([sample(0, "GPU-a", (5,))], describe=lambda pid: f"vllm serve (pid {pid})")
    assert "vllm serve (pid 5)" in text


def test_describe_process_cuts_paths_and_unknown_pids_are_marked() -> None:
    sleeper = subprocess.Popen(["/bin/sleep", "30"])
    try:
        deadline = time.monotonic() + 5
        while describe_process(sleeper.pid) != "sleep 30" and time.monotonic() < deadline:
            time.sleep(0.01)  # between fork and exec it still shows the parent's command line
        assert describe_process(sleeper.pid) == "sleep 30"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert describe_process(sleeper.pid) == "?"


def test_replica_processes_are_the_listener_and_its_children() -> None:
    """vLLM's shape: the API server listens, its child (the engine core) holds the GPU."""
    port = free_port()
    server = (
        "import socket, subprocess, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
        "child = subprocess.Popen(['sleep', '30']); print(child.pid, flush=True); time.sleep(30)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", server, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        clock = Clock()
        url = f"http://127.0.0.1:{port}"
        processes = ReplicaProcesses([url, "http://10.255.255.1:8000"], ttl_s=30, clock=clock)
        assert processes.pids() == {url: frozenset({parent.pid, child_pid})}
        found = processes.pids()
        assert processes.pids() is found  # one scan per TTL, not per call
        clock.now += 30
        assert processes.pids() is not found
    finally:
        parent.kill()
        parent.wait()
    assert ReplicaProcesses(["http://10.255.255.1:8000"]).pids() == {}
