"""The fairness benchmark runs end to end on sims, small, and writes its tables (its goals are checked in its
own output, not asserted here; only that flow control puts the light tenant ahead of the heavy one)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration


def test_fairness_benchmark_on_sims_writes_noisy_and_priority(tmp_path: Path) -> None:
    argv = ["bench", "fairness", "--experiments", "noisy,priority", "--contenders", "dpserve"]
    argv += ["--a-streams", "32", "--warmup", "1", "--window", "3"]
    argv += ["--critical-streams", "8", "--priority-warmup", "2", "--priority-window", "3"]
    argv += ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "m")]
    assert main(argv) == 0
    with open(tmp_path / "noisy.csv") as handle:
        noisy = {row["contender"]: row for row in csv.DictReader(handle)}
    assert set(noisy) == {"a-alone", "a-alone-off", "b-alone", "dpserve"}
    for row in noisy.values():
        assert row["backend"] == "sim" and row["errors"] == ""
        assert float(row["tokens_per_s"]) > 0
        for tenant in ("a", "b"):
            if int(row[f"{tenant}_streams"]):
                assert int(row[f"{tenant}_answers"]) > 0 and int(row[f"{tenant}_errors"]) == 0
    assert float(noisy["b-alone"]["b_service_ms"]) > 0
    flow = noisy["dpserve"]
    # Flow control serves the light tenant's requests first: its TTFT is well below the heavy one's.
    assert float(flow["b_ttft_p50_ms"]) < float(flow["a_ttft_p50_ms"])
    assert float(flow["vs_a_alone"]) > 0 and float(flow["vs_a_alone_off"]) > 0
    with open(tmp_path / "priority.csv") as handle:
        priority = {row["case"]: row for row in csv.DictReader(handle)}
    assert set(priority) == {"alone", "flooded"}
    for row in priority.values():
        assert int(row["critical_answers"]) > 0 and int(row["critical_errors"]) == 0
    flooded = priority["flooded"]
    assert int(flooded["batch_answers"]) > 0
    # 64 batch streams overflow 2 x 4 slots and a queue of 16: the rest are refused or shed, nothing else.
    assert int(flooded["batch_queue_full"]) + int(flooded["batch_shed"]) > 0
    assert int(flooded["batch_other_errors"]) == 0
    report = (tmp_path / "fairness.md").read_text()
    assert "B TTFT p50" in report and "critical TTFT p50 flooded/alone" in report
