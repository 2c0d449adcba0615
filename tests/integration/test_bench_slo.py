"""`dpserve bench slo` runs end to end on two sims of different speeds, small: the load sweep stops where the
default policy's attainment falls under the bound, each policy (slo, kv_aware, least_loaded) runs a round
there, and the figures it writes add up. The goals themselves are shown by the real run
(docs/benchmarks/slo.md), not here."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration

POLICIES = ("slo", "kv_aware", "least_loaded")


def test_slo_benchmark_on_sims_sweeps_then_compares_and_writes_sane_figures(tmp_path: Path) -> None:
    argv = ["bench", "slo", "--backend", "sim", "--policies", ",".join(POLICIES), "--levels", "2,24"]
    argv += ["--bursts", "3", "--gap-s", "0.3", "--rounds", "1", "--sweep-rounds", "1", "--warmup-bursts", "1"]
    argv += ["--prefix-words", "150", "--max-tokens", "8"]
    # 1 when a goal is missed: a run this small shows the harness works, not the goals.
    assert main([*argv, "--out", str(tmp_path), "--cache-dir", str(tmp_path / "m")]) in (0, 1)
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
        refused = int(row["refused"])
        assert int(row["failed"]) == 0 and int(row["best_effort_refused"]) == 0
        assert refused == 0 or row["policy"] == "slo"  # only the slo policy refuses, and only SLO requests
        assert int(row["best_effort_done"]) == int(row["best_effort_sent"])
        met, seconds = int(row["slo_met"]), float(row["seconds"])
        assert float(row["attainment"]) == pytest.approx(met / int(row["slo_sent"]), abs=1e-4)
        assert float(row["goodput"]) == pytest.approx(met / seconds, rel=2e-3)  # both rounded in the CSV
        # At least the bursts' spacing; the answers add their time.
        assert seconds > 0.3 * 2 * rounds
        ttfts = [float(row[k]) for k in ("ttft_slo_p50_ms", "ttft_slo_p99_ms", "ttft_best_effort_p50_ms")]
        assert all(0 < t < 30_000 for t in ttfts) and float(row["ttft_slo_p50_ms"]) <= float(row["ttft_slo_p99_ms"])
        assert math.isnan(float(row["refusal_p99_ms"])) == (refused == 0)
        assert refused == 0 or 0 < float(row["refusal_p99_ms"]) < 5000
        # Every request routed got a receipt naming the replica it went to; the warm-up's are not counted.
        spread = dict(part.split("=") for part in row["per_replica"].split())
        assert set(spread) <= {"fast", "slow"} and sent - refused <= sum(int(n) for n in spread.values()) <= sent
    assert all(len(r["round_goodputs"].split()) == 1 for r in compare.values())
    assert int(compare["kv_aware"]["slo_sent"]) == 3 * level // 2
    # The slo policy's receipts carry predicted and realized TTFT, per replica.
    with open(tmp_path / "predictions.csv") as handle:
        predictions = [r for r in csv.DictReader(handle) if r["policy"] == "slo"]
    assert {r["replica"] for r in predictions} <= {"fast", "slow"} and predictions
    assert sum(int(r["receipts"]) for r in predictions) <= int(compare["slo"]["slo_sent"]) * 2
    assert all(float(r["realized_p50_ms"]) > 0 and float(r["error_p50"]) >= 0 for r in predictions)
    assert 0 <= float(compare["slo"]["prediction_error_p50"]) < 100
    # Each compared round's receipts are kept as the router gave them, with the replica's name.
    kept = (tmp_path / "receipts" / f"sim-slo-{level}-1.jsonl").read_text().splitlines()
    receipts = [json.loads(line) for line in kept]
    assert len(receipts) == sum(
        int(n) for n in dict(p.split("=") for p in compare["slo"]["per_replica"].split()).values()
    )
    assert {r["replica_name"] for r in receipts} <= {"fast", "slow"}
    assert all(r["realized_ttft_ms"] is None or r["realized_ttft_ms"] > 0 for r in receipts)
    text = (tmp_path / "slo.txt").read_text()
    assert "every request answered or refused with Retry-After" in text  # the figures' sanity: met
    for goal in (
        "goodput vs kv_aware",
        "goodput vs least_loaded",
        "best-effort throughput",
        "refusals on arrival within 50 ms",
    ):
        assert goal in text
