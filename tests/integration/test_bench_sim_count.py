"""The `dpserve sim --count` benchmark runs end to end and writes its figures (none is asserted as a speed)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration


def test_sim_count_benchmark_writes_a_row_per_count(tmp_path: Path) -> None:
    assert main(["bench", "sim-count", "--counts", "1,3", "--idle-seconds", "0.5", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "sim_count.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["count"]) for row in rows] == [1, 3]
    for row in rows:
        assert int(row["errors"]) == 0  # every replica answered its scrape and its chat
        assert 10 < float(row["idle_rss_mib"]) <= float(row["chatted_rss_mib"]) + 1
        assert float(row["ready_s"]) > 0 and float(row["scrape_all_s"]) > 0
