"""`dpserve bench` finds the benchmarks in the checkout beside the package (dpserve/checkout.py), says so when
there are none, and never takes another package called `benchmarks` for them."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dpserve
from dpserve.checkout import BENCH_MODULES, NO_BENCHMARKS, benchmark_module, benchmarks_dir
from dpserve.cli import main

CHECKOUT = Path(__file__).resolve().parents[2]


@pytest.fixture
def benchmark_modules_restored() -> Iterator[None]:
    """sys.modules' `benchmarks` entries as they were before the test (other tests hold their classes)."""
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "benchmarks"}
    yield
    for name in [name for name in sys.modules if name.split(".")[0] == "benchmarks"]:
        del sys.modules[name]
    sys.modules.update(saved)


def _foreign_benchmarks(root: Path) -> Path:
    """Another distribution's top-level `benchmarks` package under `root`."""
    package = root / "benchmarks"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("FOREIGN = True\n")
    (package / "sim_cost.py").write_text("def main(argv):\n    return 99\n")
    return package


def _installed_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """dpserve as a wheel installs it: the package in site-packages, no checkout around it."""
    site_packages = tmp_path / "site-packages"
    (site_packages / "dpserve").mkdir(parents=True)
    (site_packages / "dpserve" / "__init__.py").write_text("")
    monkeypatch.setattr(dpserve, "__file__", str(site_packages / "dpserve" / "__init__.py"))
    return site_packages


def test_from_an_installed_package_without_benchmarks_it_says_so_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    site_packages = _installed_wheel(tmp_path, monkeypatch)
    assert benchmarks_dir() == site_packages / "benchmarks"
    for name in BENCH_MODULES:
        assert main(["bench", name, "--help"]) == 2
        err = capsys.readouterr().err
        assert err == NO_BENCHMARKS + "\n"
    assert "needs a checkout of the dpserve repository" in NO_BENCHMARKS


def test_another_distributions_benchmarks_in_site_packages_is_not_a_checkout(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    benchmark_modules_restored: None,
) -> None:
    site_packages = _installed_wheel(tmp_path, monkeypatch)
    _foreign_benchmarks(site_packages)
    assert main(["bench", "sim"]) == 2  # not the foreign sim_cost's 99
    assert capsys.readouterr().err == NO_BENCHMARKS + "\n"


def test_from_a_checkout_it_runs_the_checkouts_benchmarks() -> None:
    assert benchmarks_dir() == CHECKOUT / "benchmarks"
    for command in BENCH_MODULES:
        module = benchmark_module(command)
        assert Path(module.__file__ or "").resolve().parent == CHECKOUT / "benchmarks"
        assert callable(module.main)


def test_an_imported_foreign_benchmarks_package_gives_way_to_the_checkouts(
    tmp_path: Path, benchmark_modules_restored: None
) -> None:
    package = _foreign_benchmarks(tmp_path)
    spec = importlib.util.spec_from_file_location(
        "benchmarks", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None and spec.loader is not None
    foreign = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(foreign)
    for name in [name for name in sys.modules if name.split(".")[0] == "benchmarks"]:
        del sys.modules[name]
    sys.modules["benchmarks"] = foreign

    module = benchmark_module("sim")
    assert Path(module.__file__ or "").resolve() == CHECKOUT / "benchmarks" / "sim_cost.py"
    assert not hasattr(sys.modules["benchmarks"], "FOREIGN")


def test_bench_help_is_the_benchmarks_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "sim", "--help"])
    assert exit_info.value.code == 0
    assert "dpserve bench sim" in capsys.readouterr().out
