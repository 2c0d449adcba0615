"""`dpserve bench slo` runs end to end on two sims of different speeds, small: the load sweep stops where the
default policy's attainment falls under the bound, each policy runs its rounds there, and the figures it
writes add up. The goals themselves are shown by the real run (docs/benchmarks/slo.md), not here."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration

POLICIES = ("kv_aware", "least_loaded")


def test_slo_benchmark_on_sims_sweeps_then_compares_and_writes_sane_figures(tmp_path: Path) -> None:
    argv = ["bench", "slo", "--backend", "sim", "--policies", ",".join(POLICIES), "--levels", "2,24"]
    argv += [
        "--bursts",
        "3",
        "--gap-s",
        "0.3",
        "--rounds",
        "2",
        "--sweep-rounds",
        "1",
        "--prefix-words",
        "150",
        "--max-tokens",
        "8",
    ]
    assert main([*argv, "--out", str(tmp_path), "--cache-dir", str(tmp_path / "m")]) == 0
    with open(tmp_path / "slo.csv") as handle:
        rows = list(csv.DictReader(handle))
    sweep = [r for r in rows if r["phase"] == "sweep"]
    compare = {r["policy"]: r for r in rows if r["phase"] == "compare"}
    assert [r["policy"] for r in sweep] == ["kv_aware"] * len(sweep) and set(compare) == set(POLICIES)
    # The sweep stopped at the first load under 0.8 (24 at once on 8 slots is far over), and compared there.
    under = [r for r in sweep if float(r["attainment"]) < 0.8]
    assert under and under[0] is sweep[-1]
    assert {r["level"] for r in compare.values()} == {sweep[-1]["level"]}
    level = int(sweep[-1]["level"])
    for row in [*sweep, *compare.values()]:
        rounds = int(row["rounds"])
        sent = int(row["slo_sent"]) + int(row["best_effort_sent"])
        assert sent == rounds * 3 * int(row["level"]) and int(row["slo_sent"]) == sent // 2
        assert int(row["failed"]) == 0 and int(row["refused"]) == 0  # neither policy refuses
        assert int(row["best_effort_done"]) == int(row["best_effort_sent"])
        met, seconds = int(row["slo_met"]), float(row["seconds"])
        assert float(row["attainment"]) == pytest.approx(met / int(row["slo_sent"]), abs=1e-4)
        assert float(row["goodput"]) == pytest.approx(met / seconds, abs=1e-4)
        # At least the bursts' spacing; the answers add their time.
        assert seconds > 0.3 * 2 * rounds
        ttfts = [float(row[k]) for k in ("ttft_slo_p50_ms", "ttft_slo_p99_ms", "ttft_best_effort_p50_ms")]
        assert all(0 < t < 30_000 for t in ttfts) and float(row["ttft_slo_p50_ms"]) <= float(row["ttft_slo_p99_ms"])
        assert math.isnan(float(row["refusal_p99_ms"]))
        # Every request got a receipt naming the replica it went to.
        spread = dict(part.split("=") for part in row["per_replica"].split())
        assert set(spread) <= {"fast", "slow"} and sum(int(n) for n in spread.values()) == sent
    assert all(len(r["round_goodputs"].split()) == 2 for r in compare.values())
    assert int(compare["kv_aware"]["slo_sent"]) == 2 * 3 * level // 2
    text = (tmp_path / "slo.txt").read_text()
    assert "every request answered or refused with Retry-After" in text and "least_loaded" in text
