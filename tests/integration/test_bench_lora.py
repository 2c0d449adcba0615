"""The LoRA benchmark runs end to end on the session fleet's 2 real vLLM CPU replicas (`--max-loras 2`), small,
and writes its tables (its goals are checked in its own output, not asserted here; only that dpserve answered
every request, and that the replicas hold no adapter afterwards)."""

from __future__ import annotations

import csv
from pathlib import Path

import httpx
import pytest

from dpserve.cli import main
from tests.integration.conftest import Fleet

pytestmark = pytest.mark.integration


def test_lora_benchmark_on_the_fleet_writes_compare_and_hot(fleet: Fleet, tmp_path: Path) -> None:
    argv = ["bench", "lora", "--requests", "40", "--out", str(tmp_path / "out")]
    for url in fleet.replica_urls:
        argv += ["--replica", url]
    # The fleet's own cache: its tiny model is the adapters' base, and is not built again.
    argv += ["--cache-dir", str(fleet.log_path.parent / "cache")]
    assert main(argv) == 0
    out = tmp_path / "out"
    with open(out / "compare.csv") as handle:
        compare = {row["setup"]: row for row in csv.DictReader(handle)}
    assert {"dpserve", "dpserve-blind"} <= set(compare)
    assert int(compare["dpserve"]["requests"]) == 40 and int(compare["dpserve"]["failed"]) == 0, compare["dpserve"]
    for setup in ("dpserve", "dpserve-blind"):
        assert float(compare[setup]["loads"]) > 0 and float(compare[setup]["ttft_p99_ms"]) > 0
    if "vllm-router" in compare:
        assert compare["vllm-router"]["loads"] == "n/a"
    with open(out / "hot.csv") as handle:
        (hot,) = list(csv.DictReader(handle))
    assert int(hot["requests"]) == 40 and int(hot["failed"]) == 0, hot
    assert hot["hot_loaded_on"]
    report = (out / "lora.md").read_text()
    assert "loads per 100 requests" in report and "hot tiny-lora-0" in report
    for url in fleet.replica_urls:  # nothing left behind for the other tests
        cards = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [card["id"] for card in cards if card.get("parent")] == []
