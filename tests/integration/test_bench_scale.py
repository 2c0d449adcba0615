"""The scale benchmark runs end to end on a small fleet and its figures are sane (none is asserted as a
speed: the goals at 1024 replicas are the benchmark's to print, docs/benchmarks/scale.md's to record)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration


def test_scale_benchmark_on_64_replicas_in_two_processes_behind_one_and_two_routers(tmp_path: Path) -> None:
    argv = ["bench", "scale", "--counts", "64", "--per-process", "32", "--routers", "1,2", "--idle-seconds", "2"]
    argv += ["--runs", "1", "--settle-seconds", "1", "--small", "4"]
    argv += ["--groups", "16", "--prompts", "3", "--latency-requests", "20", "--decision-counts", "4,64"]
    assert main([*argv, "--out", str(tmp_path)]) == 0  # 1 when a sanity check fails
    with open(tmp_path / "scale.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(int(row["replicas"]), int(row["routers"])) for row in rows] == [(64, 1), (64, 2)]
    for row in rows:
        assert int(row["healthy"]) == 64 and int(row["errors"]) == 0
        assert 0 < float(row["idle_cpu_pct"]) <= float(row["idle_cpu_max_pct"]) < 200 and row["run"] == "1"
        # The router's own split: its parts (probes, KV events, ...) and the rest, each a share of a core.
        parts = [float(row[part]) for part in ("probes_pct", "scrapes_pct", "kv_events_pct", "peers_pct")]
        assert all(0 <= part < 100 for part in parts) and float(row["probes_pct"]) > 0
        assert 0 <= float(row["kv_events_io_pct"]) < 100 and -5 < float(row["rest_pct"]) < 200
        assert (float(row["peers_pct"]) > 0) == (row["routers"] == "2")  # peered routers follow each other
        assert 20 < float(row["rss_idle_mib"]) < 2048
        # 16 groups x 3 prompts: a partition misses each group's first prompt only, so hits are well above 0.
        assert 0 < float(row["partition_hit_rate"]) <= 1 and 0 < float(row["hit_rate"]) <= 1
        assert float(row["p50_ms"]) > 0 and float(row["small_p50_ms"]) > 0
    report = (tmp_path / "scale.md").read_text()
    assert "decision time" in report and "kv_aware: 4:" in report
