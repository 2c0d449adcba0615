"""The router-overhead benchmark runs end to end over sims and writes its figures (no speed is asserted here:
its goals are checked in its own output)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration

SHORT = ["--duration", "1", "--warmup", "0.5", "--connections", "4", "--backends", "2", "--stream-chunks", "8"]
SHORT += ["--dpserve-policies", "least_loaded", "--skip-decision"]


def rows_of(out: Path) -> list[dict[str, str]]:
    with open(out / "overhead.csv") as handle:
        return list(csv.DictReader(handle))


def assert_runs(rows: list[dict[str, str]], targets: set[str]) -> None:
    runs = {(row["target"], row["mode"], row["connections"]) for row in rows}
    assert runs == {(t, m, c) for t in targets for m in ("json", "sse") for c in ("4", "1")}
    for row in rows:
        assert float(row["req_s"]) > 0 and int(row["errors"]) == 0, row
        assert float(row["loadgen_cpu"]) > 0, row  # the generator's own CPU is measured
        routed = row["target"] != "direct"
        assert bool(row["router_cpu"]) == routed, row
        assert bool(row["added_p50_ms"]) == (routed and row["connections"] == "1"), row
        assert bool(row["chunks_s"]) == (row["mode"] == "sse"), row


def test_overhead_benchmark_with_the_python_generator(tmp_path: Path) -> None:
    targets = "direct,dpserve,vllm-router"
    assert main(["bench", "overhead", *SHORT, "--loadgen", "python", "--targets", targets, "--out", str(tmp_path)]) == 0
    rows = rows_of(tmp_path)
    assert_runs(rows, {"direct", "dpserve", "vllm-router"})
    assert {row["loadgen"] for row in rows} == {"python"}
    assert (tmp_path / "overhead.png").stat().st_size > 10_000


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not on PATH")
def test_overhead_benchmark_with_wrk(tmp_path: Path) -> None:
    targets = "direct,dpserve"
    assert main(["bench", "overhead", *SHORT, "--loadgen", "wrk", "--targets", targets, "--out", str(tmp_path)]) == 0
    rows = rows_of(tmp_path)
    assert_runs(rows, {"direct", "dpserve"})
    assert {row["loadgen"] for row in rows} == {"wrk"}
    assert (tmp_path / "overhead.png").exists()
