"""`dpserve bench vllm-dp` end to end on sims: all three contenders (vLLM's data parallelism alone, dpserve over
two replicas, dpserve inside the data-parallel server) on every workload, vLLM's own client for the random
prompts, and figures that make sense. Its goals are checked in its own output, not asserted here."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration

CONTENDERS = {"vllm-dp", "dpserve-replicas", "dpserve-engines"}
WORKLOADS = ("cache_pressure", "multi_turn", "random")


def test_vllm_dp_benchmark_on_sims_runs_all_three_contenders_with_sane_figures(tmp_path: Path) -> None:
    argv = ["bench", "vllm-dp", "--backend", "sim", "--groups", "3", "--prompts", "3", "--conversations", "2"]
    argv += ["--turns", "2", "--random-prompts", "8", "--random-input-len", "64", "--sim-speed", "2"]
    argv += ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "m")]
    assert main(argv) == 0  # 1 when a figure makes no sense
    with open(tmp_path / "vllm-dp.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["workload"], r["contender"]) for r in rows} == {(w, c) for w in WORKLOADS for c in CONTENDERS}
    sizes = {"cache_pressure": 3 * 3, "multi_turn": 2 * 2, "random": 8}
    for row in rows:
        assert int(row["requests"]) == sizes[row["workload"]] and int(row["errors"]) == 0, row
        assert 0 <= float(row["hit_rate"]) <= 1 and float(row["req_per_s"]) > 0, row
        assert 0 < float(row["ttft_p50_ms"]) <= float(row["ttft_p99_ms"]) and float(row["itl_p50_ms"]) > 0, row
        # Both engines served, and counted every request the client sent.
        per_engine = [int(n) for n in row["per_engine"].split("/")]
        assert len(per_engine) == 2 and sum(per_engine) == int(row["requests"]), row
        assert row["client"] == ("vllm bench serve" if row["workload"] == "random" else "dpserve bench")
    by_key = {(r["workload"], r["contender"]): r for r in rows}
    # Routing on prefixes beats vLLM's load-only balancer on shared prefixes, inside its server or in front of two.
    pressure = float(by_key[("cache_pressure", "vllm-dp")]["hit_rate"])
    assert float(by_key[("cache_pressure", "dpserve-engines")]["hit_rate"]) > pressure
    assert float(by_key[("cache_pressure", "dpserve-replicas")]["hit_rate"]) > pressure
    # vLLM's client wrote its own results, which the random rows were read from.
    result = json.loads((tmp_path / "vllm-bench-serve" / "sim-random-vllm-dp-0.json").read_text())
    assert result["completed"] == 8 and result["backend"] == "vllm"
    report = (tmp_path / "vllm-dp.md").read_text()
    assert "(c) dpserve inside vLLM DP" in report and "Goals" in report
