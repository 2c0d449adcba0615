"""The upstream-client benchmark runs end to end and writes its figures (no speed is asserted here)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration


def test_upstream_client_benchmark_writes_a_row_per_run(tmp_path: Path) -> None:
    argv = ["bench", "upstream-client", "--duration", "1", "--warmup", "0.2", "--connections", "4"]
    argv += ["--targets", "direct,aiohttp", "--loadgen", "python", "--out", str(tmp_path)]
    assert main(argv) == 0
    with open(tmp_path / "upstream_client.csv") as handle:
        rows = list(csv.DictReader(handle))
    runs = {(row["target"], row["mode"], row["connections"]) for row in rows}
    assert runs == {(t, m, c) for t in ("direct", "aiohttp") for m in ("json", "sse") for c in ("4", "1")}
    assert all(float(row["req_s"]) > 0 and int(row["errors"]) == 0 for row in rows)
    relayed_single = [row for row in rows if row["target"] == "aiohttp" and row["connections"] == "1"]
    assert all(row["p50_added_ms"] for row in relayed_single)  # the added latency is reported
