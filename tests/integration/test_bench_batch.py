"""The batch benchmark runs end to end on sims, small: every batch completes with each line once, the
interactive load is answered in every phase, and the replicas idle less while the batch runs (its TTFT goals
are judged in its own output, on full-size runs: docs/benchmarks/batch.md)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration


def test_batch_benchmark_on_sims_fills_idle_replicas(tmp_path: Path) -> None:
    argv = ["bench", "batch", "--experiments", "sim", "--lines", "100", "--phase-s", "3", "--warmup-s", "1"]
    argv += ["--sim-args", "--decode-ms-per-token 2", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "m")]
    assert main(argv) == 0
    with open(tmp_path / "phases.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["round"], row["phase"]) for row in rows] == [
        ("0", "alone"), ("0", "batch"), ("0", "batch"), ("0", "alone"), ("-1", "alone"), ("-1", "batch"),
    ]  # fmt: skip
    for row in rows:
        assert int(row["interactive"]) > 0 and int(row["errors"]) == 0 and float(row["ttft_p50_ms"]) > 0
        lines = 0 if row["phase"] == "alone" else 100 if row["round"] == "0" else 200
        assert int(row["batch_lines"]) == lines
    alone, batch = rows[-2], rows[-1]
    assert float(batch["idle_share"]) < float(alone["idle_share"])
    assert float(batch["replica_tokens_per_s"]) > float(alone["replica_tokens_per_s"])
    report = (tmp_path / "batch.md").read_text()
    assert "ttft_p99 with the batch" in report and "idle share falls" in report
