"""The router-tier benchmark runs end to end on a few sims, small, writes its figures, and exits 1 exactly
when one of its goal lines is not met; the goals that do not hang on timing are asserted here: sharing
routers hit as one router does, uniform load spread evenly, no request lost but those in flight on a
killed router."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration


@pytest.mark.skipif(shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists(), reason="no haproxy")
def test_router_benchmark_on_sims_writes_tiers_restart_and_workers(tmp_path: Path) -> None:
    argv = ["bench", "routers", "--replicas", "2", "--routers", "2", "--repeat", "1", "--groups", "4"]
    argv += ["--prompts", "3", "--prefix-words", "120", "--concurrency", "4", "--uniform-requests", "24"]
    argv += [
        "--workloads",
        "shared_prefix,uniform",
        "--tiers",
        "one,shared,alone",
        "--restart-groups",
        "4",
        "--steady",
        "2",
        "--after",
        "2",
    ]
    argv += ["--workers", "1,2", "--worker-seconds", "1", "--worker-connections", "4"]
    argv += ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "m")]
    status = main(argv)
    report = (tmp_path / "routers.md").read_text()
    assert status == (1 if ": NOT met" in report else 0), report
    assert report.count(": met") + report.count(": NOT met") == 2 + 3  # shared_prefix, uniform; 3 restarts
    with open(tmp_path / "routers.csv") as handle:
        tiers = list(csv.DictReader(handle))
    assert {(r["workload"], r["tier"], r["run"]) for r in tiers} == {
        (w, t, run) for w in ("shared_prefix", "uniform") for t in ("one", "shared", "alone") for run in ("0", "-1")
    }
    for row in tiers:
        assert int(row["errors"]) == 0 and int(row["requests"]) > 0
        assert sum(int(n) for n in row["per_replica"].split("/")) == int(row["requests"])
    means = {(r["workload"], r["tier"]): r for r in tiers if r["run"] == "-1"}
    # Sharing routers hit as one router does (the requests dealt over 2 routers in turn); uniform prompts
    # spread evenly.
    assert float(means["shared_prefix", "shared"]["hit_vs_one"]) >= 0.95, means["shared_prefix", "shared"]
    one = means["shared_prefix", "one"]
    assert float(one["hit_rate"]) >= 0.95 * float(one["oracle"]), one  # and one router hits what can be hit
    assert float(means["uniform", "shared"]["max_share"]) <= 1.25, means["uniform", "shared"]
    with open(tmp_path / "restart.csv") as handle:
        restarts = list(csv.DictReader(handle))
    assert [r["start"] for r in restarts] == ["warm", "cold", "alone"]
    for row in restarts:
        assert int(row["requests"]) > 0 and int(row["failed_other"]) == 0, row  # the goal: 0
        assert float(row["restarted_after_s"]) > 0
    with open(tmp_path / "workers.csv") as handle:
        workers = list(csv.DictReader(handle))
    assert [(r["case"], r["workers"]) for r in workers][:3] == [("alone", "1"), ("peered", "1"), ("workers", "2")]
    assert all(float(r["req_per_s"]) > 0 and int(r["errors"]) == 0 for r in workers)
    assert "sharing routers hit" in report
