"""On a real NVIDIA GPU, with the real NVML library: readings, a busy GPU tied to its replica by
process, and the router's /status and /metrics. Skipped without a GPU (marker `gpu`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dpserve.config import RouterSettings
from dpserve.gpu.local_processes import ReplicaProcesses
from dpserve.gpu.nvml import NvmlReader, count_nvidia_gpus, load_nvml
from dpserve.gpu.placement import ReplicaClue
from dpserve.gpu.sampler import GpuSampler
from dpserve.gpu.topology import UNKNOWN, group_gpus, read_topology
from dpserve.router.app import create_app
from tests.conftest import free_port, serving

pytestmark = pytest.mark.gpu

GPUS, WHY_NONE = count_nvidia_gpus()
if not GPUS:
    pytest.skip(f"needs a GPU: {WHY_NONE}", allow_module_level=True)


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def replica(*args: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`python ARGS` with `{port}` in ARGS set to a free port, until it answers /health."""
    port = free_port()
    command = [sys.executable, *(arg.format(port=port) for arg in args)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not answers(url):
            assert process.poll() is None and time.monotonic() < deadline, "the replica did not start"
            time.sleep(0.2)
        yield url, process
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def busy_replica() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    pytest.importorskip("torch", reason="the GPU load is made with PyTorch")
    with replica(str(Path(__file__).with_name("gpu_replica.py")), "{port}", "120") as running:
        yield running


def test_real_nvml_reads_every_gpu() -> None:
    reader = NvmlReader(load_nvml())
    reader.open()
    try:
        gpus = reader.read()
    finally:
        reader.close()
    assert len(gpus) == GPUS
    for gpu in gpus:
        print(gpu)
        assert gpu.readable and gpu.uuid.startswith("GPU-") and gpu.name
        assert gpu.memory_total_bytes and 0 <= (gpu.memory_used_bytes or 0) <= gpu.memory_total_bytes
        assert gpu.utilization_gpu is not None and 0 <= gpu.utilization_gpu <= 1
        assert gpu.temperature_celsius is not None and 0 < gpu.temperature_celsius < 120
        assert gpu.power_watts is not None and gpu.power_watts > 0
        assert gpu.sm_clock_mhz is not None and gpu.sm_clock_mhz > 0


def test_real_nvml_topology_is_read_for_every_pair() -> None:
    """The NVLink P2P and common-ancestor calls through the real library: known distances for every pair
    (not UNKNOWN, which the fake answers without a topology), symmetric, and a grouping by them."""
    topology, why = read_topology()
    assert why is None and topology is not None
    print(topology)
    assert topology.count == GPUS
    for a in range(GPUS):
        assert topology.distance[a][a] == 0
        for b in range(GPUS):
            assert topology.distance[a][b] == topology.distance[b][a]
            assert a == b or topology.distance[a][b] < UNKNOWN, (a, b)
    size = 2 if GPUS % 2 == 0 else 1
    groups = group_gpus(topology, size)
    assert sorted(gpu for group in groups for gpu in group) == list(range(GPUS))


def test_a_busy_gpu_is_seen_and_tied_to_its_replica_by_process(
    busy_replica: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, parent = busy_replica
    processes = ReplicaProcesses([url])
    sampler = GpuSampler(load_nvml, 0.2, clues=lambda: [ReplicaClue("r0", (), processes.pids()[url])])
    deadline = time.monotonic() + 30
    snapshot = sampler.sample_once()
    while time.monotonic() < deadline:
        snapshot = sampler.sample_once()
        if snapshot.replica_gpus.get("r0") and (snapshot.gpus[0].utilization_gpu or 0) > 0.5:
            break
        time.sleep(0.2)
    print(snapshot)
    assert snapshot.replica_gpus["r0"] == (0,)
    gpu = snapshot.gpus[0]
    assert gpu.utilization_gpu is not None and gpu.utilization_gpu > 0.5
    # The child (the "engine core"), not the HTTP parent, holds the memory: found through the tree.
    holders = [p for p in gpu.processes if p.pid in processes.pids()[url] and p.pid != parent.pid]
    assert holders and (holders[0].used_memory_bytes or 0) >= 1 << 30


def test_dpserve_gpus_lists_the_busy_process(busy_replica: tuple[str, subprocess.Popen[bytes]]) -> None:
    done = subprocess.run([sys.executable, "-m", "dpserve", "gpus"], capture_output=True, text=True, check=True)
    print(done.stdout)
    assert done.stdout.splitlines()[0].startswith("GPU")
    assert "gpu_replica.py" in done.stdout  # the GPU child, under the replica's `dpserve sim`


async def test_router_reports_the_gpu_of_its_replica(busy_replica: tuple[str, subprocess.Popen[bytes]]) -> None:
    """Two replicas: r0 on the GPU (found by process), r1 a plain sim on no GPU."""
    url, _ = busy_replica
    with replica("-m", "dpserve", "sim", "--tokenizer", "fast", "--log-level", "warning", "--port", "{port}") as (
        plain,
        _,
    ):
        # Named: an unnamed replica's id is its host:port (found on the lent H100, 2026-11-27).
        settings = RouterSettings(replicas=(f"r0={url}", f"r1={plain}"), gpu_interval_s=0.2, probe_interval_s=0.5)
        app = create_app(settings)
        async with serving(app, "warning") as router, httpx.AsyncClient(base_url=router, timeout=30) as client:
            body = {"prompt": "hello", "max_tokens": 64}
            streams = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(6)]
            await asyncio.sleep(0.3)  # status taken with requests in flight
            status = (await client.get("/status")).json()
            assert all(r.status_code == 200 for r in await asyncio.gather(*streams))
            metrics = (await client.get("/metrics")).text
            dashboard = await client.get("/dashboard")
    if os.environ.get("DPSERVE_GPU_STATUS_OUT"):
        out = Path(os.environ["DPSERVE_GPU_STATUS_OUT"])
        await asyncio.to_thread(out.write_text, json.dumps(status, indent=2))
    print(json.dumps(status["gpus"], indent=2))
    print("\n".join(line for line in metrics.splitlines() if line.startswith("dpserve_gpu")))
    assert status["gpus"]["available"] is True
    assert [r["healthy"] for r in status["replicas"]] == [True, True]
    assert sum(r["in_flight"] for r in status["replicas"]) == 6
    assert status["replicas"][1]["gpus"] == []
    (gpu,) = status["replicas"][0]["gpus"]
    assert gpu["index"] == 0 and gpu["uuid"].startswith("GPU-") and gpu["replica"] == "r0"
    # host="": this host's GPU (an agent's carry its host)
    assert f'dpserve_gpu_utilization_ratio{{gpu="0",host="",replica="r0",uuid="{gpu["uuid"]}"}}' in metrics
    assert f'dpserve_gpu_up{{gpu="0",host="",replica="r0",uuid="{gpu["uuid"]}"}} 1.0' in metrics
    assert dashboard.status_code == 200 and gpu["uuid"] in dashboard.text
