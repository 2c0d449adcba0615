"""The package as a user gets it: `python -m build` makes an sdist and, from it, a wheel, which `twine check`
passes; the wheel alone, installed with its dependencies (pip as configured on this machine, no engine) into a
fresh virtual environment outside the checkout, answers `dpserve --version`, serves a chat request through
`dpserve up --sim 2`, and says what `dpserve bench` needs.

Costs (measured here, pip's cache warm): the build about 5 s, the install about 20 s, the fleet about 3 s."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dpserve.checkout import NO_BENCHMARKS
from tests.conftest import free_port_range
from tests.integration.conftest import checkout_files, stop_process, wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
INSTALL_TIMEOUT_S = 600


def _outside_env() -> dict[str, str]:
    """This environment less what would let the checkout or the test's own venv leak into the new one."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build`'s sdist and wheel (the wheel built from the sdist, as build does by default)."""
    work = tmp_path_factory.mktemp("build")
    source = checkout_files(work / "src")
    out = work / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    return out


@pytest.fixture(scope="module")
def wheel_venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtual environment, outside the checkout, with the wheel and its dependencies alone."""
    home = tmp_path_factory.mktemp("user")
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (wheel,) = dist.glob("dpserve-*.whl")
    started = time.monotonic()
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
        check=True,
        cwd=home,
        env=_outside_env(),
        timeout=INSTALL_TIMEOUT_S,
    )
    print(f"wheel installed with its dependencies in {time.monotonic() - started:.1f} s")
    yield venv


def test_sdist_and_wheel_pass_twine_check_and_hold_the_package(dist: Path) -> None:
    (wheel,) = dist.glob(f"dpserve-{VERSION}-py3-none-any.whl")
    (sdist,) = dist.glob(f"dpserve-{VERSION}.tar.gz")
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2, checked.stdout
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(f"dpserve-{VERSION}.dist-info/METADATA").decode()
    assert "dpserve/cli.py" in names and f"dpserve-{VERSION}.dist-info/licenses/LICENSE" in names
    assert not [name for name in names if name.startswith(("tests/", "benchmarks/"))]
    assert "License-Expression: Apache-2.0" in metadata and "Requires-Python: >=3.11" in metadata
    with tarfile.open(sdist) as archive:
        members = {member.name.split("/", 1)[-1] for member in archive.getmembers()}
    assert {"LICENSE", "README.md", "pyproject.toml", "dpserve/cli.py"} <= members


def test_the_wheel_alone_says_its_version_and_what_bench_needs(wheel_venv: Path) -> None:
    home = wheel_venv.parent
    env = _outside_env()
    dpserve = str(wheel_venv / "bin" / "dpserve")
    version = subprocess.run([dpserve, "--version"], cwd=home, env=env, capture_output=True, text=True, timeout=60)
    assert version.stdout.split() == ["dpserve", VERSION], version.stderr
    where = subprocess.run(
        [str(wheel_venv / "bin" / "python"), "-c", "import dpserve; print(dpserve.__file__)"],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert Path(where.stdout.strip()).is_relative_to(wheel_venv), "the wheel's package, not the checkout's"
    bench = subprocess.run([dpserve, "bench", "policies"], cwd=home, env=env, capture_output=True, text=True)
    assert bench.returncode == 2 and bench.stderr == NO_BENCHMARKS + "\n"


def test_the_wheel_alone_serves_a_chat_through_up_sim(wheel_venv: Path) -> None:
    home = wheel_venv.parent
    router_port = free_port_range(1)
    base_port = free_port_range(2, start=router_port + 100)
    kv_base_port = free_port_range(2, start=base_port + 100)
    command = [str(wheel_venv / "bin" / "dpserve"), "up", "--sim", "2", "--port", str(router_port)]
    command += ["--base-port", str(base_port), "--kv-events-base-port", str(kv_base_port)]
    command += ["--run-dir", str(home / "run")]
    log_path = home / "dpserve-up.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=home, env=_outside_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{router_port}"
    try:
        wait_until(lambda: "router ready at" in log_path.read_text() or process.poll() is not None, 60, 0.2, "router")
        assert process.poll() is None, log_path.read_text()
        body = {"model": "dpserve-tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["message"]["content"]
    finally:
        stop_process(process, 60)
    assert process.returncode == 0, log_path.read_text()
    assert "stopped every replica and the router" in log_path.read_text()
