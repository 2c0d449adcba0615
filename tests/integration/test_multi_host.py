"""A two-host fleet rehearsed on one machine: hosts are the loopback addresses 127.0.0.2 and 127.0.0.3,
each with two `dpserve sim` replicas and its own `dpserve agent` reading GPUs faked at the NVML boundary
(their processes are the sims' real pids, so the agent ties them to ports through the real /proc). One
router, run as users run it, finds the replicas and the agents by DNS (dnsmasq) and must tie every GPU
to its replica across both hosts; a GPU that throttles on one host degrades that host's replica only."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pynvml
import pytest

from benchmarks.screenshot import rendered_dom
from tests.chromium import find_chromium
from tests.fake_nvml import FAKE_NVML_FILE, FakeGpu, write_gpus
from tests.integration.conftest import answers, start_router, stop_process, stop_router, wait_until
from tests.integration.hosts import dns_server, free_port_on, sims_at

pytestmark = pytest.mark.integration

HOSTS = {"127.0.0.2": "host-a", "127.0.0.3": "host-b"}
REPO = Path(__file__).resolve().parents[2]
AGENT_PORT = 9400
SAVE_STATUS = "DPSERVE_SAVE_MULTI_HOST_STATUS"


@contextlib.contextmanager
def agent_at(address: str, port: int, hostname: str, gpus_file: Path) -> Iterator[str]:
    """`dpserve agent` bound to `address`, its NVML a fake read from `gpus_file`."""
    command = [sys.executable, "-m", "dpserve", "agent", "--host", address, "--port", str(port)]
    command += ["--hostname", hostname, "--interval", "0.2", "--nvml", "tests.fake_nvml:from_file"]
    command += ["--log-level", "warning"]
    env = {**os.environ, FAKE_NVML_FILE: str(gpus_file)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://{address}:{port}"
    try:
        wait_until(lambda: answers(f"{url}/health") or process.poll() is not None, 30, 0.1, f"agent at {address}")
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else "agent exited"
        yield url
    finally:
        stop_process(process, 10)


def test_one_router_ties_every_gpu_of_two_hosts_to_its_replica(tmp_path: Path) -> None:
    addresses = list(HOSTS)
    first, second = free_port_on(*addresses), free_port_on(*addresses)
    agent_port = AGENT_PORT if _free(addresses, AGENT_PORT) else free_port_on(*addresses)
    with contextlib.ExitStack() as stack:
        dns = stack.enter_context(dns_server(tmp_path))
        sims = [stack.enter_context(sims_at(port, *addresses)) for port in (first, second)]
        files: dict[str, Path] = {}
        gpus: dict[str, list[FakeGpu]] = {}
        for address, hostname in HOSTS.items():
            # Two GPUs per host, one per replica there, and a third nothing runs on.
            gpus[address] = [
                FakeGpu(f"GPU-{hostname}-{i}", util_gpu=70, processes=[(sims[i][address].process.pid, 20 << 30)])
                for i in range(2)
            ] + [FakeGpu(f"GPU-{hostname}-spare")]
            files[address] = tmp_path / f"{hostname}.json"
            write_gpus(files[address], gpus[address])
            stack.enter_context(agent_at(address, agent_port, hostname, files[address]))
        dns.set_records({"vllm.test": addresses, "gpu-agents.test": addresses})

        flags = ["--discover", f"dns:vllm.test:{first}", "--discover", f"dns:vllm.test:{second}"]
        flags += ["--discover-agents", f"dns:gpu-agents.test:{agent_port}", "--discover-nameserver", dns.nameserver]
        flags += ["--discover-interval", "0.3", "--gpu-interval", "0.2", "--gpu-degrade-after", "0"]
        router = start_router([], "least_loaded", *flags, expect_healthy=4)
        stack.callback(stop_router, router)

        def status() -> dict[str, Any]:
            return httpx.get(f"{router.url}/status", timeout=5).json()

        wait_until(lambda: sum(d["replica"] is not None for d in status()["gpus"]["devices"]) == 4, 20, 0.1, "GPUs")
        state = status()
        url_of = {replica["id"]: replica["url"] for replica in state["replicas"]}
        tied = {
            (device["host"], device["uuid"]): url_of.get(device["replica"]) if device["replica"] else None
            for device in state["gpus"]["devices"]
        }
        expected: dict[tuple[str, str], str | None] = {}
        for address, hostname in HOSTS.items():
            for i, port in enumerate((first, second)):
                expected[(hostname, f"GPU-{hostname}-{i}")] = f"http://{address}:{port}"
            expected[(hostname, f"GPU-{hostname}-spare")] = None
        assert tied == expected
        agents = {agent["url"]: agent for agent in state["gpus"]["agents"]}
        assert set(agents) == {f"http://{address}:{agent_port}" for address in addresses}
        assert all(a["error"] is None and a["gpus"] == 3 and a["found_by"] for a in agents.values())
        for replica in state["replicas"]:
            (gpu,) = replica["gpus"]
            assert gpu["host"] in HOSTS.values() and replica["url"].startswith(f"http://{_address(gpu['host'])}:")
        metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
        sick_url = f"http://127.0.0.3:{second}"
        sick_id = next(rid for rid, url in url_of.items() if url == sick_url)
        labels = f'gpu="1",host="host-b",replica="{sick_id}",uuid="GPU-host-b-1"'
        assert f"dpserve_gpu_utilization_ratio{{{labels}}} 0.7" in metrics

        # host-b's second GPU throttles: that replica, and only it, is degraded, the reason naming the host.
        gpus["127.0.0.3"][1].throttle_reasons = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
        write_gpus(files["127.0.0.3"], gpus["127.0.0.3"])
        wait_until(lambda: _degraded(status()) != {}, 10, 0.1, "the degraded replica")
        assert _degraded(status()) == {sick_url: ["GPU 1 on host-b: throttled: hw_power_brake"]}
        assert all(
            httpx.post(f"{router.url}/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2}, timeout=10).headers[
                "x-dpserve-replica"
            ]
            != sick_id
            for i in range(12)
        )

        # The status page shows every host's GPUs and the one in trouble (a real browser runs its script).
        if find_chromium() is not None:
            dom = rendered_dom(f"{router.url}/dashboard", tmp_path / "profile")
            cards = re.findall(r'<div class="gpu" data-gpu="(\d)" data-host="([^"]*)">(.*?)</div></div>', dom, re.S)
            # By host, then by index.
            assert [(host, gpu) for gpu, host, _ in cards] == [
                (host, str(i)) for host in sorted(HOSTS.values()) for i in range(3)
            ]
            assert "GPU 1 on host-b" in dom and "degraded: throttled: hw_power_brake" in dom
            (row,) = re.findall(rf'<tr data-replica="{sick_id}">(.*?)</tr>', dom, re.S)
            assert "degraded" in row and 'title="GPU 1 on host-b: throttled: hw_power_brake"' in row
            assert "<td>GPU 1 on host-b 70%</td>" in row
        if os.environ.get(SAVE_STATUS):  # for the README's picture: benchmarks.screenshot --status-json FILE
            Path(os.environ[SAVE_STATUS]).write_text(json.dumps(status(), indent=1))


def _degraded(state: dict[str, Any]) -> dict[str, list[str]]:
    return {replica["url"]: replica["degraded"] for replica in state["replicas"] if replica["degraded"]}


def _address(hostname: str) -> str:
    return next(address for address, name in HOSTS.items() if name == hostname)


def _free(addresses: list[str], port: int) -> bool:
    try:
        for address in addresses:
            with socket.socket() as sock:
                sock.bind((address, port))
    except OSError:
        return False
    return True
