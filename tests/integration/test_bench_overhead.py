"""The router-overhead benchmark runs end to end, over sims and over the fast scripted backends, and writes
its figures (no speed is asserted here: its goals are checked in its own output). wrk is installed by
`make test`, as the README's figures use it: no skip without it."""

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


def exit_matches_verdicts(code: int, out: str) -> None:
    """The benchmark's exit status says whether its printed goal lines were all met: 1 when any says FAIL."""
    verdicts = [line for line in out.splitlines() if line.endswith((" PASS", " FAIL"))]
    assert verdicts, out
    assert code == (1 if any(line.endswith(" FAIL") for line in verdicts) else 0), (code, verdicts)


def test_overhead_benchmark_with_the_python_generator_over_sims(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    targets = "direct,dpserve,vllm-router"
    command = ["bench", "overhead", *SHORT, "--loadgen", "python", "--backend", "sim", "--targets", targets]
    code = main([*command, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "dpserve(least_loaded)/vllm-router(round_robin) req/s" in out and "goal >= 0.8x" in out
    exit_matches_verdicts(code, out)
    rows = rows_of(tmp_path)
    assert_runs(rows, {"direct", "dpserve", "vllm-router"})
    assert {row["loadgen"] for row in rows} == {"python"}
    assert (tmp_path / "overhead.png").stat().st_size > 10_000


def test_overhead_benchmark_with_wrk_in_abba_rounds_against_a_commit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two rounds (the second in reverse order) over the fast backends, with this commit's router also run
    from a worktree of HEAD (`--against`): every target in both rounds, and one ratio per round."""
    assert shutil.which("wrk"), "wrk is not on PATH: `make test` installs it"
    command = [
        "bench",
        "overhead",
        *SHORT,
        "--loadgen",
        "wrk",
        "--targets",
        "direct,dpserve",
        "--rounds",
        "2",
        "--warmup",
        "0",
    ]
    code = main([*command, "--against", "HEAD", "--out", str(tmp_path)])
    rows = rows_of(tmp_path)
    assert_runs([row for row in rows if row["round"] == "1"], {"direct", "dpserve", "dpserve@HEAD"})
    assert_runs([row for row in rows if row["round"] == "2"], {"direct", "dpserve", "dpserve@HEAD"})
    first = [
        row["target"] for row in rows if row["round"] == "1" and row["mode"] == "json" and row["connections"] == "4"
    ]
    second = [
        row["target"] for row in rows if row["round"] == "2" and row["mode"] == "json" and row["connections"] == "4"
    ]
    assert second == first[::-1]  # ABBA
    out = capsys.readouterr().out
    assert "dpserve(least_loaded)/dpserve@HEAD(least_loaded) req/s" in out and "(rounds: " in out
    exit_matches_verdicts(code, out)
    assert {row["loadgen"] for row in rows} == {"wrk"}
    assert (tmp_path / "overhead.png").exists()
