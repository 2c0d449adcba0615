"""benchmarks/receipt_errors.py: realized less predicted cached tokens over a receipts log, per prediction source
and policy, with the classes and the blocks the receipts were classed against."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.receipt_errors import errors, main, report


def row(
    source: str | None, policy: str, predicted: int | None, realized: int | None, verdict: str, block: int
) -> dict[str, object]:
    return {
        "source": source,
        "policy": policy,
        "predicted_cached_tokens": predicted,
        "realized_cached_tokens": realized,
        "class": verdict,
        "block_tokens": block,
    }


ROWS = [
    row("routed_text", "prefix", 0, 0, "cold", 16),
    row("routed_text", "prefix", 64, 160, "mispredicted", 32),
    row("kv_events", "kv_aware", 96, 96, "hit", 16),
    row("routed_text", "prefix", 128, 96, "hit", 32),
    row("routed_text", "prefix", 96, 32, "evicted", 32),
    row(None, "round_robin", None, 48, "unscored", 0),
]


def test_errors_are_realized_less_predicted_per_source_and_policy() -> None:
    text, events, unscored = errors(ROWS)
    assert (text.source, text.policy, text.receipts, text.scored) == ("routed_text", "prefix", 4, 4)
    assert (text.lowest, text.highest) == (-64, 96)
    assert text.mean == pytest.approx((0 + 96 - 32 - 64) / 4) and text.median == pytest.approx(-16)
    assert text.classes == {"cold": 1, "mispredicted": 1, "hit": 1, "evicted": 1}
    assert text.block_tokens == {16: 1, 32: 3}
    assert (events.source, events.lowest, events.highest, events.mean) == ("kv_events", 0, 0, 0.0)
    # A policy that predicts nothing: counted, no error.
    assert (unscored.source, unscored.receipts, unscored.scored, unscored.mean) == ("None", 1, 0, 0.0)


def test_main_prints_a_table_per_log_and_fails_on_an_empty_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "receipts.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert main([str(log)]) == 0
    out = capsys.readouterr().out
    assert out == report(errors(ROWS))
    assert out.splitlines()[1].split() == ["routed_text", "prefix", "4", "4", "-64", "96", "+0.0", "-16.0"]
    assert "routed_text prefix: classes cold=1 evicted=1 hit=1 mispredicted=1;" in out and "16=1 32=3" in out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([str(empty)]) == 1
