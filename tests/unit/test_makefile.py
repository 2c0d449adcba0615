"""The Makefile's two installs, read from `make -n` (what it would run, nothing run): `make run` installs the
package and its engine alone, `make test` the test and bench extras besides; both through tools/pip-args.sh;
torchvision and torchaudio are removed only on the CPU, and only where they do not import."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(target: str, engine: str, venv: Path) -> list[str]:
    # Run under `make test` too (CI): without the outer make's variables, and without its "Entering directory".
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", target, f"ENGINE={engine}", f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def _installs(lines: list[str]) -> list[str]:
    return [line for line in lines if " -m pip install " in line]


def test_make_run_installs_only_what_running_needs(tmp_path: Path) -> None:
    for engine in ("cpu", "gpu"):
        lines = _dry_run("run", engine, tmp_path / "venv")
        (install,) = _installs(lines)
        assert f"tools/pip-args.sh {engine})" in install and f"-e '.[{engine}]'" in install
        assert lines[-1].strip().endswith("/bin/dpserve up"), lines[-1]


def test_make_test_installs_the_test_and_bench_extras_in_one_go(tmp_path: Path) -> None:
    lines = _dry_run("install", "cpu", tmp_path / "venv")
    (install,) = _installs(lines)
    assert "-e '.[cpu,test,bench]'" in install and "tools/pip-args.sh cpu)" in install
    # The full install counts for `make run` too: it does not install again after `make test`.
    assert any(line.startswith("touch ") and line.endswith(f"{tmp_path}/venv/.installed-cpu-run") for line in lines)


def test_only_the_cpu_engine_may_lose_torchvision_and_torchaudio(tmp_path: Path) -> None:
    cpu = "\n".join(_dry_run("run", "cpu", tmp_path / "venv"))
    gpu = "\n".join(_dry_run("run", "gpu", tmp_path / "venv"))
    assert "-c 'import torchvision, torchaudio' 2>/dev/null ||" in cpu and "uninstall -y torchvision" in cpu
    assert "uninstall" not in gpu and "torchvision" not in gpu
