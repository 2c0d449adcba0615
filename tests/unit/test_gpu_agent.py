"""`dpserve agent`: what it serves (JSON the router reads back, DCGM-named metrics) and how it tells where
a GPU process takes connections (real processes, real /proc)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pynvml
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from dpserve.agent.app import create_agent_app
from dpserve.agent.reading import ReachableCache
from dpserve.config import AgentSettings
from dpserve.gpu.listeners import Reachable, cgroup_identity, reachable
from dpserve.router.fleet.agents import parse_reading
from tests.fake_nvml import FakeGpu, FakeNvml

POD = "0f3c9a52-1b7e-4c1a-9d4e-8a6b2c3d4e5f"
CONTAINER = "a" * 64


def lookup(pid: int) -> Reachable:
    return {4242: Reachable(("10.1.2.3:8000",), CONTAINER, POD)}.get(pid, Reachable())


def test_gpus_json_is_what_the_router_reads_and_metrics_use_dcgm_names() -> None:
    hot = pynvml.nvmlClocksEventReasonHwThermalSlowdown
    gpus = [
        FakeGpu("GPU-aaaa", util_gpu=87, memory_used=60 << 30, processes=[(4242, 59 << 30)], throttle_reasons=hot),
        FakeGpu("GPU-bbbb", unsupported={"power"}, xid_queue=[79]),
    ]
    app = create_agent_app(AgentSettings(hostname="node-7", interval_s=0.05), lambda: FakeNvml(gpus), lookup)
    with TestClient(app) as client:
        time.sleep(0.2)  # a reading after the Xid arrived
        reading = parse_reading(client.get("/gpus").json())
        metrics = client.get("/metrics").text
        assert client.get("/health").status_code == 200
    assert reading.host == "node-7" and reading.unavailable is None
    first, second = reading.gpus
    assert first.uuid == "GPU-aaaa" and first.throttle_reasons == hot
    (process,) = first.processes
    assert (process.pid, process.listens, process.container, process.pod) == (4242, ("10.1.2.3:8000",), CONTAINER, POD)
    assert second.power_watts is None and (second.xid_errors, second.last_xid) == (1, 79)

    samples = {
        (sample.name, sample.labels["UUID"]): sample
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if "UUID" in sample.labels
    }
    util = samples[("DCGM_FI_DEV_GPU_UTIL", "GPU-aaaa")]
    assert util.value == 87.0
    assert util.labels == {
        "gpu": "0",
        "UUID": "GPU-aaaa",
        "device": "nvidia0",
        "modelName": "NVIDIA H100 80GB HBM3",
        "Hostname": "node-7",
        "container": CONTAINER,
        "pod": POD,
    }
    assert samples[("DCGM_FI_DEV_FB_USED", "GPU-aaaa")].value == 60 * 1024
    assert samples[("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "GPU-aaaa")].value == hot
    assert samples[("DCGM_FI_DEV_XID_ERRORS", "GPU-bbbb")].value == 79  # DCGM: the last Xid's code
    assert samples[("dpserve_agent_xid_errors", "GPU-bbbb")].value == 1
    assert ("DCGM_FI_DEV_POWER_USAGE", "GPU-bbbb") not in samples  # not supported: left out, not 0
    assert samples[("DCGM_FI_DEV_POWER_USAGE", "GPU-aaaa")].value == 70.0


def test_a_host_without_nvml_still_serves_and_says_why() -> None:
    def no_library() -> FakeNvml:
        nvml = FakeNvml([])
        nvml.init_error = pynvml.NVMLError_LibraryNotFound()
        return nvml

    app = create_agent_app(AgentSettings(hostname="cpu-box"), no_library, lookup)
    with TestClient(app) as client:
        body = client.get("/gpus").json()
        metrics = client.get("/metrics").text
    assert body["gpus"] == [] and "no NVIDIA" in body["unavailable"]
    assert "dpserve_agent_nvml_up 0.0" in metrics


def test_a_gpu_process_is_reachable_at_its_parents_listening_socket() -> None:
    # The shape of a vLLM replica: an API server listening on ADDRESS:PORT, its child (the engine) on the GPU.
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        port = probe.getsockname()[1]
    server = (
        "import socket, subprocess, sys, time\n"
        f"s = socket.socket(); s.bind(('127.0.0.2', {port})); s.listen()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        found = reachable(child)
        assert f"127.0.0.2:{port}" in found.listens
        assert reachable(parent.pid).listens == found.listens
        assert reachable(2**22 + 7).listens == ()  # no such process: nothing, no error
    finally:
        parent.kill()
        parent.wait()


def test_container_and_pod_ids_come_from_the_cgroup_path(tmp_path: Path) -> None:
    (tmp_path / "77").mkdir()
    cgroup = f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/cri-containerd-{CONTAINER}.scope\n"
    (tmp_path / "77" / "cgroup").write_text(cgroup)
    assert cgroup_identity(77, tmp_path) == (CONTAINER, POD)
    (tmp_path / "77" / "cgroup").write_text("0::/user.slice/session-3.scope\n")
    assert cgroup_identity(77, tmp_path) == (None, None)


def test_where_a_process_listens_is_looked_up_again_only_after_the_ttl_and_forgotten_when_gone() -> None:
    calls: list[int] = []
    now = [0.0]

    def counting(pid: int) -> Reachable:
        calls.append(pid)
        return Reachable((f"10.0.0.1:{pid}",))

    cache = ReachableCache(counting, ttl_s=10, clock=lambda: now[0])
    assert cache(1).listens == ("10.0.0.1:1",) and cache(1).listens == ("10.0.0.1:1",)
    now[0] = 9.9
    cache(1)
    assert calls == [1]
    now[0] = 10.0
    cache(1)
    cache(2)
    assert calls == [1, 1, 2]
    cache.keep_only({2})
    cache(1)  # gone and back (a reused pid): looked up afresh
    cache(2)
    assert calls == [1, 1, 2, 1]
