"""The LoRA benchmark runs end to end on the session fleet's 2 real vLLM CPU replicas (`--max-loras 2`), small
(2 rounds of 20 requests), and writes its tables: every round's rows and their medians (its goals are checked in
its own output and its exit status, which must agree; here, that dpserve answered every request, and that the
replicas hold no adapter afterwards)."""

from __future__ import annotations

import csv
from pathlib import Path

import httpx
import pytest

from dpserve.cli import main
from tests.integration.conftest import Fleet

pytestmark = pytest.mark.integration

REQUESTS = 20  # a round, per setup: enough for several adapters, loads and the hot one's spread


def test_lora_benchmark_on_the_fleet_writes_compare_and_hot(fleet: Fleet, tmp_path: Path) -> None:
    argv = ["bench", "lora", "--requests", str(REQUESTS), "--repeat", "2", "--out", str(tmp_path / "out")]
    for url in fleet.replica_urls:
        argv += ["--replica", url]
    # The fleet's own cache: its tiny model is the adapters' base, and is not built again.
    argv += ["--cache-dir", str(fleet.log_path.parent / "cache")]
    code = main(argv)
    out = tmp_path / "out"
    # Its exit status says whether its goal lines (in lora.md) were all met.
    report = (out / "lora.md").read_text()
    assert " met" in report
    assert code == (1 if "NOT met" in report else 0), report
    with open(out / "compare.csv") as handle:
        compare = {(row["setup"], int(row["run"])): row for row in csv.DictReader(handle)}
    setups = {setup for setup, _ in compare}
    assert {"dpserve", "dpserve-blind"} <= setups
    assert set(compare) == {(setup, run) for setup in setups for run in (0, 1, -1)}
    for run in (0, 1):
        ours = compare["dpserve", run]
        assert int(ours["requests"]) == REQUESTS and int(ours["failed"]) == 0, ours
        for setup in ("dpserve", "dpserve-blind"):
            assert float(compare[setup, run]["loads"]) > 0 and float(compare[setup, run]["ttft_p99_ms"]) > 0
    # The medians' row: the rounds' requests summed, each figure the median of the rounds' own (of two rounds,
    # their mean, to 3 decimals).
    median = compare["dpserve", -1]
    assert int(median["requests"]) == 2 * REQUESTS and int(median["failed"]) == 0, median
    for name in ("ttft_p99_ms", "loads"):
        rounds = [float(compare["dpserve", run][name]) for run in (0, 1)]
        assert float(median[name]) == pytest.approx(round(sum(rounds) / 2, 3), abs=1e-9), (name, rounds, median)
    if "vllm-router" in setups:
        assert compare["vllm-router", -1]["loads"] == "n/a"
    with open(out / "hot.csv") as handle:
        hot = {int(row["run"]): row for row in csv.DictReader(handle)}
    assert set(hot) == {0, 1, -1}
    for run in (0, 1):
        assert int(hot[run]["requests"]) == REQUESTS and int(hot[run]["failed"]) == 0, hot[run]
        assert hot[run]["hot_loaded_on"]
    assert int(hot[-1]["requests"]) == 2 * REQUESTS
    report = (out / "lora.md").read_text()
    assert (
        "loads per 100 requests" in report
        and "hot tiny-lora-0" in report
        and f"2 rounds of {REQUESTS} requests" in report
    )
    for url in fleet.replica_urls:  # nothing left behind for the other tests
        cards = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [card["id"] for card in cards if card.get("parent")] == []
