"""`python -m benchmarks.instructions`: its report and the flags it gives each checkout's router (the count
itself needs valgrind and minutes; it is run by hand, results in benchmarks/results/overhead/instructions-*)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from benchmarks.fleet import CHECKOUT
from benchmarks.instructions import Count, parse_args, report, slow_probes


def test_report_gives_each_checkout_per_request_and_against_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    counts = [
        Count("here", "json", 400, 200_000_000),
        Count("old", "json", 400, 160_000_000),
        Count("here", "json", 400, 204_000_000),
    ]
    report(counts, tmp_path)
    out = capsys.readouterr().out
    assert "json here: 505.0k per request (spread 2.0%), 1.000x here" in out
    assert "json old: 400.0k per request (spread 0.0%), 0.792x here" in out
    with open(tmp_path / "instructions.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["per_request"] for row in rows] == ["500000", "400000", "510000"]


def test_this_checkouts_router_gets_every_slow_probe_flag() -> None:
    flags = slow_probes(CHECKOUT)
    assert flags == [
        "--probe-interval", "3600", "--quiet-probe-interval", "3600", "--linked-quiet-probe-interval", "3600",
    ]  # fmt: skip


def test_too_few_requests_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--requests", "10"])
