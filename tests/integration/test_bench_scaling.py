"""`dpserve bench scaling` end to end on sims, briefly: real replicas, router and Locust per count, and the
CSV, table and plot it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scaling import EFFICIENCY_CEILING, load_rows

pytestmark = pytest.mark.integration


def test_scaling_benchmark_runs_and_writes_its_report(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "dpserve", "bench", "scaling", "--backend", "sim", "--replicas", "1,2"]
    command += ["--duration", "5", "--warmup", "1", "--output-tokens", "16", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = tmp_path / "sim"
    rows = load_rows(out / "scaling.csv")
    assert [r.replicas for r in rows] == [1, 2]
    assert all(r.requests > 0 and r.errors == 0 and r.ttft_p50_ms > 0 and r.load_processes == 1 for r in rows)
    assert rows[0].efficiency == 1.0
    # Twice the replicas and users: clearly more throughput (the exact figure is the benchmark's job).
    assert rows[1].req_per_s > 1.5 * rows[0].req_per_s
    # The benchmark itself refuses an efficiency above EFFICIENCY_CEILING (exit 1, checked above).
    assert 0.75 < rows[1].efficiency <= EFFICIENCY_CEILING
    assert rows[1].router_cpu > 0 and rows[1].locust_cpu > 0 and rows[1].machine_cpu > 0
    assert (out / "scaling.png").stat().st_size > 10_000
    assert "| efficiency |" in (out / "scaling.md").read_text()
    assert "scaling efficiency at 2 replicas" in result.stdout
    assert (out / "locust" / "n2_stats.csv").exists() and (out / "locust" / "n2.html").exists()
