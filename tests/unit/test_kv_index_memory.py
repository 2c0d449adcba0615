"""`python -m benchmarks.kv_index_memory`: the KV index's memory per entry, measured with tracemalloc, and the
router's own estimate of it (`dpserve_kv_index_bytes`) agree where each prompt is on one replica."""

from __future__ import annotations

import pytest

from benchmarks.kv_index_memory import main, measure


def test_the_estimate_is_within_a_fifth_of_the_measured_memory() -> None:
    held, measured, estimated = measure(entries=20_000, replicas=4, copies=1, seed=3)
    assert held >= 20_000
    assert 0.8 <= estimated / measured <= 1.2, (measured, estimated)
    # Entries on two replicas share their key's holders dict: fewer bytes each, never more.
    _, shared, _ = measure(entries=20_000, replicas=4, copies=2, seed=3)
    assert shared < measured


def test_it_prints_a_row_per_case_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--entries", "5000", "--replicas", "2", "--copies", "1,2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "GiB" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2"]
