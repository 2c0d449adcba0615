"""The simulator-cost benchmark runs end to end and writes its figures (no speed is asserted here)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration


def test_sim_cost_benchmark_writes_a_row_per_run(tmp_path: Path) -> None:
    argv = ["bench", "sim", "--sims", "2", "--duration", "0.5", "--connections", "4", "--idle-seconds", "0.5"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    with open(tmp_path / "sim_cost.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {(row["target"], row["mode"]) for row in rows} == {
        (t, m) for t in ("1 sim", "2 sims") for m in ("json", "sse")
    }
    for row in rows:
        assert int(row["errors"]) == 0 and float(row["req_per_s"]) > 0
        assert float(row["sim_cpu_us_per_request"]) > 0 and float(row["idle_rss_mib"]) > 10
