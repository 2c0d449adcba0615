"""`dpserve bench` finds the benchmarks in the checkout beside the package, and says so when there are none."""

from __future__ import annotations

from pathlib import Path

import pytest

import dpserve
from dpserve.cli import BENCH_MODULES, NO_BENCHMARKS, benchmark_module, benchmarks_dir, main

CHECKOUT = Path(__file__).resolve().parents[2]


def test_from_an_installed_package_without_benchmarks_it_says_so_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # An installed wheel: the package in site-packages, nothing called benchmarks/ beside it.
    package = tmp_path / "site-packages" / "dpserve"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.setattr(dpserve, "__file__", str(package / "__init__.py"))
    assert benchmarks_dir() == tmp_path / "site-packages" / "benchmarks"
    for name in BENCH_MODULES:
        assert main(["bench", name, "--help"]) == 2
        err = capsys.readouterr().err
        assert err == NO_BENCHMARKS + "\n"
    assert "needs a checkout of the dpserve repository" in NO_BENCHMARKS


def test_from_a_checkout_it_runs_the_checkouts_benchmarks() -> None:
    assert benchmarks_dir() == CHECKOUT / "benchmarks"
    for module_name in BENCH_MODULES.values():
        module = benchmark_module(module_name)
        assert module is not None and Path(module.__file__ or "").resolve().parent == CHECKOUT / "benchmarks"
        assert callable(module.main)


def test_bench_help_is_the_benchmarks_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "sim", "--help"])
    assert exit_info.value.code == 0
    assert "dpserve bench sim" in capsys.readouterr().out
