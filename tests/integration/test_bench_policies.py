"""The policy benchmark runs end to end on sims, against vllm-router, writes its figures, and meets its
stated goals (it exits 1 when one is missed): kv_aware at 0.95 of the oracle or more, above round robin,
and as high as vllm-router's cache_aware."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpserve.cli import main

pytestmark = pytest.mark.integration


def test_policy_benchmark_on_sims_writes_rows_plots_and_tables(tmp_path: Path) -> None:
    argv = ["bench", "policies", "--backend", "sim", "--replicas", "2", "--groups", "4", "--prompts", "3"]
    argv += ["--conversations", "3", "--turns", "2", "--prefix-words", "120", "--concurrency", "2"]
    argv += ["--workloads", "shared_prefix,multi_turn", "--policies", "kv_aware,round_robin", "--rounds", "2"]
    argv += ["--vllm-router-policies", "cache_aware", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "m")]
    assert main(argv) == 0
    with open(tmp_path / "policies.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["workload"], r["contender"]) for r in rows} == {
        (w, c)
        for w in ("shared_prefix", "multi_turn")
        for c in ("dpserve:kv_aware", "dpserve:round_robin", "vllm-router:cache_aware")
    }
    sizes = {"shared_prefix": 4 * 3, "multi_turn": 3 * 2}  # with 2, round robin sometimes kept each on one replica
    for row in rows:
        # Two rounds pooled: each sent the whole workload, and kept its own hit rate.
        assert int(row["errors"]) == 0 and int(row["requests"]) == 2 * sizes[row["workload"]]
        assert len(row["round_hit_rates"].split()) == 2
        assert sum(int(n) for n in row["per_replica"].split("/")) == int(row["requests"])
    hits = {(r["workload"], r["contender"]): float(r["hit_rate"]) for r in rows}
    for workload in sizes:
        oracle = next(float(r["oracle"]) for r in rows if r["workload"] == workload)
        ours = hits[workload, "dpserve:kv_aware"]
        # The goals: near the oracle, clearly above round robin (which spreads each group over both
        # replicas), and no lower than vllm-router's cache_aware.
        assert ours >= 0.95 * oracle and ours > 1.25 * hits[workload, "dpserve:round_robin"], (workload, hits)
        assert ours >= hits[workload, "vllm-router:cache_aware"], (workload, hits)
    kv = next(r for r in rows if r["contender"] == "dpserve:kv_aware" and r["workload"] == "shared_prefix")
    assert "cache_hit=" in kv["reasons"]
    # Every request of both rounds got a receipt; round robin was scored in kv_aware's shadow.
    classes = dict(part.split("=") for part in kv["receipt_classes"].split())
    assert sum(int(n) for n in classes.values()) == int(kv["requests"])
    assert {part.split("=")[0] for part in kv["shadows"].split()} == {"live", "round_robin", "least_loaded"}
    assert (tmp_path / "policies-sim.png").stat().st_size > 10_000
    assert "dpserve:kv_aware" in (tmp_path / "policies.md").read_text()
    with open(tmp_path / "tokenize.csv") as handle:
        cost = next(csv.DictReader(handle))
    assert float(cost["local_p50_us"]) > 0 and float(cost["remote_p50_us"]) > 0


PRESSURE_ARGV = ["--policies", "kv_aware,slo", "--vllm-router-policies", "", "--rounds", "4"]
PRESSURE_ARGV += ["--groups", "8", "--prompts", "6"]
PRESSURE_ARGV += ["--conversations", "4", "--turns", "4", "--prefix-words", "170"]
GUARD_FLOOR = 0.90
"""Of the partitioned oracle, every round: 0.95-1.04 now; 0.62-0.88 in some round of every run when one router
tied near-equal held counts as peered routers had to (db66630, docs/benchmarks/policies.md). Room under the
lowest seen: a round where one request of a group lands on the other replica is placement working."""


def _pressure_rounds(out: Path, workloads: tuple[str, ...]) -> list[dict[str, str]]:
    with open(out / "policies.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["workload"], r["contender"]) for r in rows} == {
        (w, c) for w in workloads for c in ("dpserve:kv_aware", "dpserve:slo")
    }
    return rows


def _assert_at_the_partition(rows: list[dict[str, str]]) -> None:
    for row in rows:
        ratios = [float(x) for x in row["round_vs_oracle"].split()]
        shares = [float(x) for x in row["round_max_shares"].split()]
        assert len(ratios) == len(shares) == 4 and int(row["errors"]) == 0, row
        # Each round a fresh router over emptied caches: its hit rate near the partition's, no replica given a
        # group or conversation more than a partition gives it.
        assert min(ratios) >= GUARD_FLOOR and max(shares) <= 1.1, (row["workload"], row["contender"], ratios, shares)
        assert float(row["oracle"]) > 0.3  # the caches hold a partition's prefixes: there are hits to lose


@pytest.mark.engine
def test_one_router_places_new_prefixes_as_a_partition_would_on_real_vllm_under_cache_pressure(tmp_path: Path) -> None:
    """The guard the policies' cache-pressure regression was missing: 2 vLLM CPU replicas with small caches
    (96 blocks of 32 tokens: the 8 groups' ~570-token prefixes, and the 4 conversations' histories, fit the
    fleet, not one replica), grouped and multi-turn traffic through one router, kv_aware and the default
    policy, 4 rounds each, each its own draw of prompts (placed by the prefixes' hash, some draws split 5/3,
    others 4/4). With 6 conversations not even a partition keeps them (the oracle thrashes too) and a round
    moved with the machine's timing: 0.794 once, with the fix."""
    workloads = ("cache_pressure", "multi_turn_pressure")
    argv = ["bench", "policies", "--backend", "vllm", "--workloads", ",".join(workloads), *PRESSURE_ARGV]
    argv += ["--vllm-block-size", "32", "--pressure-blocks", "96", "--out", str(tmp_path)]
    argv += ["--cache-dir", str(tmp_path / "m")]
    status = main(argv)
    _assert_at_the_partition(_pressure_rounds(tmp_path, workloads))
    assert status == 0


def test_one_router_places_new_prefixes_as_a_partition_would_on_sims_under_cache_pressure(tmp_path: Path) -> None:
    """The same guard's grouped prefixes on 2 sims (the simulator's LRU cache, 96 blocks of 32 tokens). Not the
    conversations: a sim answers in a few milliseconds, so its turns' placements come apart from the
    partition's replay by more than the placement (0.85-1.11 of it, round by round)."""
    argv = ["bench", "policies", "--backend", "sim", "--replicas", "2", "--concurrency", "4", *PRESSURE_ARGV]
    argv += ["--workloads", "cache_pressure", "--sim-block-size", "32", "--pressure-blocks", "96"]
    argv += ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "m")]
    status = main(argv)
    _assert_at_the_partition(_pressure_rounds(tmp_path, ("cache_pressure",)))
    assert status == 0
