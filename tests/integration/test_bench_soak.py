"""`dpserve bench soak` end to end, briefly: real sims and routers under unique prompts, with bounds so small
that each policy's index must evict (kv_aware's KV index, prefix's text index); the router's reported index
sizes must reach their bounds and never pass them.
(RSS flatness needs minutes, so it is the benchmark's verdict, not asserted here.)"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpserve.cli import main

# The signal timeout interrupts the benchmark in this process, so its `finally` stops every child.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120, method="signal")]

KV_BOUND = 2000
PREFIX_BOUND = 1000


def test_soak_benchmark_keeps_both_indexes_at_their_bounds(tmp_path: Path) -> None:
    argv = ["bench", "soak", "--policies", "kv_aware,prefix", "--duration", "8", "--sample-interval", "1"]
    argv += ["--warmup", "2", "--kv-index-max-entries", str(KV_BOUND), "--prefix-index-max-chunks", str(PREFIX_BOUND)]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    with open(tmp_path / "soak.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {row["policy"] for row in rows} == {"kv_aware", "prefix"}
    for policy in ("kv_aware", "prefix"):
        mine = [row for row in rows if row["policy"] == policy]
        assert len(mine) >= 8 and int(mine[-1]["requests"]) > 0 and int(mine[-1]["errors"]) == 0
        assert all(float(row["rss_mib"]) > 10 for row in mine)
    kv_aware = [row for row in rows if row["policy"] == "kv_aware"]
    # The router's own bound (its /metrics) is the one asked for, and its index reached and kept it.
    assert {int(row["kv_bound"]) for row in kv_aware} == {KV_BOUND}
    kv = [int(row["kv_entries"]) for row in kv_aware]
    assert max(kv) == KV_BOUND and int(kv_aware[-1]["kv_evicted"]) > 0
    # prefix reads no KV blocks: given the replicas' events all the same, it keeps no KV index.
    assert all(row["kv_entries"] == "" for row in rows if row["policy"] == "prefix")
    # kv_aware keeps prompts' token ids in an LRU of 4096 (the default): never more.
    cached = [int(row["token_cache_entries"]) for row in rows if row["policy"] == "kv_aware"]
    assert 0 < max(cached) <= 4096
    chunks = [int(row["prefix_chunks"]) for row in rows if row["policy"] == "prefix"]
    assert max(chunks) == PREFIX_BOUND
    assert all(row["prefix_chunks"] == "" for row in rows if row["policy"] == "kv_aware")
    assert (tmp_path / "soak.png").stat().st_size > 10_000
