"""`dpserve bench slo`'s arithmetic on outcomes made here: goodput and attainment, the load search, the round
order, the prediction error from receipts, and the goal lines (no sockets)."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks.slo import (
    Outcome,
    Results,
    Row,
    comparison_level,
    cores,
    error_code,
    has_content,
    pooled_error,
    prediction_errors,
    ratio,
    round_orders,
    slo_flags,
    spread,
    summarize,
    verdicts,
)


def answered(ttft_ms: float, slo_ms: float | None = 300.0) -> Outcome:
    return Outcome(slo_ms, 200, ttft_ms / 1000, ttft_ms / 1000 + 0.2, done=True)


def refused(after_ms: float, slo_ms: float | None = 300.0, retry_after: bool = True) -> Outcome:
    return Outcome(slo_ms, 429, answered_s=after_ms / 1000, retry_after=retry_after, code="slo_unattainable")


def test_goodput_counts_slo_requests_whose_first_token_came_in_time_per_second() -> None:
    outcomes = [
        answered(120),
        answered(300),  # on the SLO: met
        answered(301),  # late: not met, but answered
        refused(4),  # refused: not met, costs nothing
        Outcome(300.0, 429, answered_s=0.31, retry_after=True, code="slo_unattainable", waited=True),  # apart
        answered(900, None),
        answered(50, None),
        Outcome(None, 0, answered_s=1.0, code="ClientConnectionError"),  # a best-effort request lost
    ]
    f = summarize(outcomes, 2.0)
    assert (f.slo_sent, f.slo_met, f.refused, f.best_effort_sent, f.best_effort_done) == (5, 2, 2, 3, 2)
    assert f.refused_after_wait == 1
    assert f.goodput == 1.0 and f.attainment == 0.4 and f.best_effort_per_s == 1.0
    assert f.failed == 1 and f.failed_late == 0  # the lost one carried no SLO
    assert f.refusal_p50_ms == f.refusal_p99_ms == pytest.approx(4.0) and f.refusals_without_retry_after == 0
    # TTFT per class, answered requests only (nearest rank).
    assert (f.ttft_slo_p50_ms, f.ttft_slo_p99_ms) == (pytest.approx(300), pytest.approx(301))
    assert (f.ttft_best_effort_p50_ms, f.ttft_best_effort_p99_ms) == (pytest.approx(50), pytest.approx(900))


def test_an_slo_request_failed_past_its_deadline_is_counted_late_and_a_429_without_retry_after_is_counted() -> None:
    late = Outcome(300.0, 502, answered_s=0.8, code="upstream_error")
    early = Outcome(300.0, 503, answered_s=0.01)
    f = summarize([late, early, refused(10, retry_after=False)], 1.0)
    assert (f.failed, f.failed_late, f.refusals_without_retry_after, f.slo_met) == (2, 1, 1, 0)
    assert f.attainment == 0.0 and f.goodput == 0.0


def test_no_requests_or_no_time_give_nan_not_a_division_error() -> None:
    f = summarize([], 0.0)
    assert math.isnan(f.goodput) and math.isnan(f.attainment) and math.isnan(f.refusal_p99_ms)
    assert math.isnan(summarize([answered(10, None)], 1.0).attainment)


def test_the_load_search_takes_the_first_load_under_the_bound_in_the_order_swept() -> None:
    assert comparison_level([(2, 1.0), (4, 0.85), (8, 0.79), (16, 0.2)], 0.8) == 8
    assert comparison_level([(2, 1.0), (4, 0.8)], 0.8) is None  # at the bound is not below it
    assert comparison_level([(2, math.nan), (4, 0.5)], 0.8) == 4  # a load with no SLO figure is not chosen
    assert comparison_level([], 0.8) is None


def test_rounds_alternate_the_policy_order() -> None:
    assert round_orders(["slo", "kv_aware", "least_loaded"], 3) == [
        ["slo", "kv_aware", "least_loaded"],
        ["least_loaded", "kv_aware", "slo"],
        ["slo", "kv_aware", "least_loaded"],
    ]


def test_half_the_requests_carry_the_slo_the_same_ones_for_a_seed() -> None:
    flags = slo_flags(9, 3)
    assert sum(flags) == 4 and len(flags) == 9 and flags == slo_flags(9, 3)
    assert any(slo_flags(40, s) != slo_flags(40, 0) for s in range(1, 4))


def test_prediction_error_per_replica_is_the_median_relative_error_of_receipts_with_both() -> None:
    receipts = [
        {"replica": "r0", "predicted_ttft_ms": 110.0, "realized_ttft_ms": 100.0},
        {"replica": "r0", "predicted_ttft_ms": 50.0, "realized_ttft_ms": 100.0},
        {"replica": "r0", "predicted_ttft_ms": 100.0, "realized_ttft_ms": 100.0},
        {"replica": "r1", "predicted_ttft_ms": 300.0, "realized_ttft_ms": 200.0},
        {"replica": "r1", "predicted_ttft_ms": None, "realized_ttft_ms": 200.0},  # no prediction: left out
        {"replica": "r1", "predicted_ttft_ms": 100.0, "realized_ttft_ms": None},  # refused or cut: left out
        {"replica": "r0"},
    ]
    fast, slow = prediction_errors(receipts, {"r0": "fast", "r1": "slow"})
    assert (fast.replica, fast.receipts, fast.predicted_p50_ms, fast.realized_p50_ms) == ("fast", 3, 100.0, 100.0)
    assert fast.error_p50 == pytest.approx(0.1)
    assert (slow.replica, slow.receipts, slow.error_p50) == ("slow", 1, pytest.approx(0.5))
    assert pooled_error(receipts) == pytest.approx(0.5)  # nearest rank of 0, 0.1, 0.5, 0.5
    assert prediction_errors(receipts, {})[0].replica == "r0"  # unnamed: the router's id
    assert math.isnan(pooled_error([{"replica": "r0"}]))


def test_the_spread_counts_receipts_per_named_replica() -> None:
    receipts = [{"replica": "r1"}, {"replica": "r0"}, {"replica": "r1"}, {"replica": None}, {"replica": "r9"}]
    assert spread(receipts, {"r0": "fast", "r1": "slow"}) == "fast=1 r9=1 slow=2"
    assert spread([], {}) == ""


def test_ratio_of_goodputs_when_one_is_zero() -> None:
    assert ratio(3.0, 2.0) == 1.5 and ratio(1.0, 0.0) == math.inf and math.isnan(ratio(0.0, 0.0))


def row(policy: str, outcomes: list[Outcome], seconds: float = 10.0, error: float = math.nan) -> Row:
    return Row("vllm", "compare", 8, policy, 2, summarize(outcomes, seconds), prediction_error_p50=error)


def test_the_goals_hold_only_when_slo_beats_both_keeps_best_effort_and_refuses_fast() -> None:
    best_effort = [answered(100, None)] * 10
    slo = row("slo", [answered(100)] * 13 + [refused(20)] * 7 + best_effort, error=0.12)
    default = row("kv_aware", [answered(100)] * 10 + [answered(900)] * 10 + best_effort)
    least = row("least_loaded", [answered(100)] * 8 + [answered(900)] * 12 + best_effort)
    goals = verdicts(Results([slo, default, least]))
    assert all(ok for _, ok in goals), goals
    assert "goodput vs kv_aware 1.30x, goal >= 1.3x: met" in goals[1][0]
    assert "refusals on arrival within 50 ms at p99 (7 refused, p99 20 ms; 0 more after a wait" in "\n".join(
        g for g, _ in goals
    )
    # Each missed goal turns its own line false.
    slow_refusals = row("slo", [answered(100)] * 13 + [refused(60)] * 7 + best_effort, error=0.12)
    assert [ok for _, ok in verdicts(Results([slow_refusals, default, least]))].count(False) == 1
    fewer_best = row("slo", [answered(100)] * 13 + [refused(20)] * 7 + best_effort[:8], error=0.12)
    lines = verdicts(Results([fewer_best, default, least]))
    assert [line for line, ok in lines if not ok] == [
        "vllm load 8: slo best-effort throughput vs kv_aware 0.80x, goal >= 0.9x: NOT met"
    ]
    off = row("slo", [answered(100)] * 13 + [refused(20)] * 7 + best_effort, error=0.25)
    assert [ok for _, ok in verdicts(Results([off, default, least]))].count(False) == 1
    # Without the slo policy only the sanity of the figures is claimed; a failed request is nonsense.
    broken = row("kv_aware", [*default_outcomes(), Outcome(300.0, 500, answered_s=0.1)])
    assert verdicts(Results([broken])) == [("vllm compare 8 kv_aware: 1 failed ()", False)]
    # A sweep that never fell under the bound says so.
    assert verdicts(Results([default], unfound=["vllm"]))[1][1] is False


def default_outcomes() -> list[Outcome]:
    return [answered(100), answered(100, None)]


def test_error_code_and_content_are_read_from_bodies_and_chunks() -> None:
    assert error_code(b'{"error": {"message": "no replica", "code": "slo_unattainable"}}') == "slo_unattainable"
    assert error_code(b'{"error": {"type": "overloaded"}}') == "overloaded"
    assert error_code(b"not json") == "" and error_code(b"[1]") == ""
    assert not has_content(b'{"choices": [{"delta": {"role": "assistant", "content": ""}}]}')
    assert has_content(b'{"choices": [{"delta": {"content": "hi"}}]}')
    assert not has_content(b'{"choices": [], "usage": {}}') and not has_content(b"{")


def test_a_core_list_is_checked() -> None:
    assert cores("0-1") == "0-1" and cores("1") == "1" and cores("0,2") == "0,2"
    for bad in ("", "a", "0-", "0;1"):
        with pytest.raises(argparse.ArgumentTypeError):
            cores(bad)
