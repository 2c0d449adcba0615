"""The one door from the package to the benchmarks: `dpserve bench COMMAND` runs a module of `benchmarks/`,
which lives beside `dpserve/` in a checkout of the repository and is not installed with the package (the
benchmarks need the checkout: its loadtests/, its committed results, the `bench` extra's tools).

This module finds that directory, says plainly when there is none (dpserve installed from a wheel), and loads
only the modules BENCH_MODULES names, as the `benchmarks` package of that directory. tests/unit/test_layering.py
reads BENCH_MODULES as this module's edges into benchmarks/ and checks that no other module reaches them."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import dpserve

PACKAGE = "benchmarks"

# `dpserve bench COMMAND`: the module of benchmarks/ that runs it, each with `main(argv) -> int`.
BENCH_MODULES = {
    "upstream-client": "upstream_client",
    "sim": "sim_cost",
    "sim-count": "sim_count",
    "scale": "scale",
    "policies": "policies",
    "routers": "routers",
    "scaling": "scaling",
    "soak": "soak",
    "overhead": "overhead",
    "cost": "cost",
    "fairness": "fairness",
    "lora": "lora",
    "vllm-dp": "vllm_dp",
    "slo": "slo",
    "batch": "batch",
    "elastic": "elastic",
}

NO_BENCHMARKS = (
    "dpserve bench needs a checkout of the dpserve repository: the benchmarks (benchmarks/, loadtests/) are not "
    "part of the installed package, and they need the `bench` extra's tools (vllm-router, sglang-router, locust, "
    "py-spy, matplotlib) and, for real replicas, an engine. In a clone of the repository, `make install` puts all "
    "of it into .venv; then run .venv/bin/dpserve bench COMMAND there"
)


class NoCheckout(LookupError):
    """This dpserve is an installed package: no checkout, so no benchmarks, beside it."""


def benchmarks_dir() -> Path:
    """Where a checkout keeps the benchmarks: `benchmarks/` beside the `dpserve/` package directory."""
    return Path(dpserve.__file__).resolve().parents[1] / PACKAGE


def is_checkout(root: Path) -> bool:
    """Whether `root` is a checkout with its benchmarks. Its pyproject.toml tells it from site-packages, where
    another distribution may have installed a top-level `benchmarks` package of its own."""
    return (root / "pyproject.toml").is_file() and (root / PACKAGE / "__init__.py").is_file()


def load_benchmarks_package(directory: Path) -> None:
    """`benchmarks` in sys.modules as the package in `directory` (the benchmarks import each other as
    `benchmarks.NAME`), without putting the checkout on sys.path for every other import."""
    loaded = sys.modules.get(PACKAGE)
    if loaded is not None and [Path(p).resolve() for p in getattr(loaded, "__path__", [])] == [directory]:
        return  # already the checkout's (under pytest, or a second `main` in one process)
    for name in [name for name in sys.modules if name == PACKAGE or name.startswith(PACKAGE + ".")]:
        del sys.modules[name]  # another `benchmarks` and its modules must not answer for the checkout's
    spec = importlib.util.spec_from_file_location(
        PACKAGE, directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {directory} as the {PACKAGE} package")
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)


def benchmark_module(command: str) -> ModuleType:
    """The module that runs `dpserve bench COMMAND`, from the checkout this dpserve runs from; NoCheckout
    (its message says what to do) when there is none."""
    directory = benchmarks_dir()
    if not is_checkout(directory.parent):
        raise NoCheckout(NO_BENCHMARKS)
    load_benchmarks_package(directory)
    return importlib.import_module(f"{PACKAGE}.{BENCH_MODULES[command]}")


def run_benchmark(command: str, argv: Sequence[str]) -> int:
    """`dpserve bench COMMAND ARGV...`: the benchmark parses its own flags and returns the exit status; 2, and
    NO_BENCHMARKS on stderr, where there is no checkout."""
    try:
        module = benchmark_module(command)
    except NoCheckout as exc:
        print(exc, file=sys.stderr)
        return 2
    status: int = module.main(list(argv))  # every benchmark's `main(argv) -> int`
    return status
