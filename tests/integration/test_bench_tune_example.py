"""`python -m benchmarks.tune_example --engine sim`, small (4 clients x 6 requests on 2 sims): the fleet records a
receipt for every request, `dpserve tune` replays them all, and the run writes what docs/receipts.md cites (its
figures are checked by the run itself, which exits 1 when one is off)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.tune_example import main

pytestmark = pytest.mark.integration


def test_the_tune_example_on_sims_records_replays_and_writes_its_files(tmp_path: Path) -> None:
    assert main(["--engine", "sim", "--requests", "6", "--out", str(tmp_path)]) == 0
    tune = (tmp_path / "tune.txt").read_text().splitlines()
    assert tune[0] == "$ dpserve tune --receipts receipts.jsonl --top 3"
    assert tune[1].startswith("24 requests over ") and "2 replicas" in tune[1]
    assert sum(line.startswith("#") for line in tune) == 3
    assert any(line.startswith("best: --kv-load-weight ") for line in tune)
    receipts = [json.loads(line) for line in (tmp_path / "receipts.jsonl").read_text().splitlines()]
    assert len(receipts) == 24 and all(r["policy"] == "kv_aware" and r["keys"] for r in receipts)
    figures = (tmp_path / "figures.txt").read_text()
    assert "24 receipts in the log" in figures and "FAIL" not in figures
    run = (tmp_path / "run.txt").read_text()
    assert run.startswith("$ python -m benchmarks.tune_example --engine sim --requests 6 --out ")
    assert " --policy kv_aware " in run and "--receipts-sample 1 --receipts-log <work>/receipts.jsonl --sim 2" in run
    assert "dpserve-tune-example-" not in run  # the scratch folder is <work>
