"""The realistic router-cost benchmark runs end to end: 2 sims with KV events, dpserve's kv_aware (its tokenizer
found in the router) and least_loaded beside vllm-router's cache_aware, ABBA, and writes its figures (no speed
is asserted here: its goals are checked in its own output and exit status)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration

TARGETS = ["dpserve:kv_aware", "dpserve:least_loaded", "vllm-router:cache_aware"]


def test_cost_benchmark_in_abba_rounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    command = ["bench", "cost", "--rounds", "2", "--groups", "4", "--prompts", "3", "--settle-s", "0.5"]
    code = main([*command, "--targets", ",".join(TARGETS), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    with open(tmp_path / "cost.csv") as handle:
        rows = list(csv.DictReader(handle))
    # ABBA: the second round runs the targets in reverse.
    assert [row["target"] for row in rows] == TARGETS + TARGETS[::-1]
    for row in rows:
        assert int(row["requests"]) == 12 and int(row["errors"]) == 0, row
        assert float(row["cpu_us_per_request"]) > 0 and 0 < float(row["hit_rate"]) <= 1, row
    kv_aware = [row for row in rows if row["target"] == "dpserve:kv_aware"]
    # The router found the tiny model's tokenizer itself, checked it against the sims' and used it.
    assert all("local=" in row["tokens_from"] for row in kv_aware), kv_aware
    assert "prompts of" in out and "tokens on average" in out
    goals = [line for line in out.splitlines() if line.startswith("dpserve:") and "goal <=" in line]
    assert len(goals) == 1, out  # kv_aware vs cache_aware; least_loaded's partner is not in this run
    assert code == (1 if any(line.endswith("NOT met") for line in goals) else 0)
