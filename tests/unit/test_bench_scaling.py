"""`dpserve bench scaling`'s arithmetic: Locust's CSV to throughput and latency, efficiency, the table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.scaling import (
    ScalingRow,
    histogram_percentile,
    load_processes_for,
    load_rows,
    nonsense,
    save_rows,
    summarize,
    with_efficiency,
)


def _entry(method: str, name: str, times: dict[str, int], failures: int = 0, content: int = 0) -> dict:
    return {
        "method": method,
        "name": name,
        "num_requests": sum(times.values()),
        "num_failures": failures,
        "response_times": times,
        "total_content_length": content,
    }


def test_summarize_counts_the_window_only_and_reads_llm_entries() -> None:
    entries = [
        _entry("POST", "(warmup) /v1/chat/completions [stream]", {"900": 50}, failures=1),
        _entry("POST", "/v1/chat/completions [stream]", {"800": 200, "1500": 100}, failures=2),
        _entry("POST", "/v1/completions", {"400": 100}),
        _entry("LLM", "TTFT", {"50": 150, "70": 100, "300": 47, "700": 3}),
        _entry("LLM", "ITL", {"11": 18000, "40": 900}),
        _entry("LLM", "output_tokens", {"64": 400}, content=400 * 64),
        _entry("LLM", "arrival dropped", {"0": 3}, failures=3),
    ]
    summary = summarize(entries, window_s=20)
    assert summary["requests"] == 400
    assert summary["errors"] == 1 + 2 + 3  # warm-up failures count as errors too
    assert summary["req_per_s"] == 20
    assert summary["output_tok_per_s"] == 400 * 64 / 20
    assert (summary["ttft_p50_ms"], summary["ttft_p99_ms"]) == (50, 300)
    assert (summary["itl_p50_ms"], summary["itl_p99_ms"]) == (11, 40)
    # The median over both request entries merged (not the warm-up's).
    assert summary["latency_p50_ms"] == 800


def test_histogram_percentile() -> None:
    assert histogram_percentile({}, 0.5) == 0
    assert histogram_percentile({"3": 1, "1": 1, "2": 2}, 0.5) == 2
    assert histogram_percentile({"3": 1, "1": 1, "2": 2}, 1.0) == 3
    assert summarize([], window_s=10)["requests"] == 0


def _row(replicas: int, req_per_s: float) -> ScalingRow:
    return ScalingRow(
        backend="sim",
        policy="least_loaded",
        replicas=replicas,
        users=10 * replicas,
        arrival_rate=0.0,
        load_processes=1,
        window_s=30.0,
        requests=int(req_per_s * 30),
        errors=0,
        req_per_s=req_per_s,
        output_tok_per_s=req_per_s * 64,
        ttft_p50_ms=70.0,
        ttft_p99_ms=700.0,
        itl_p50_ms=11.0,
        itl_p99_ms=15.0,
        latency_p50_ms=750.0,
        efficiency=0.0,
        router_cpu=0.1,
        replicas_cpu=0.1,
        locust_cpu=0.1,
        machine_cpu=0.4,
        cores=2,
    )


def test_efficiency_is_relative_to_the_smallest_count(tmp_path: Path) -> None:
    rows = with_efficiency([_row(1, 10.0), _row(2, 19.0), _row(8, 76.0)])
    assert [round(r.efficiency, 3) for r in rows] == [1.0, 0.95, 0.95]
    # Starting at 2 replicas: thr(N) / (N/2 x thr(2)).
    assert [round(r.efficiency, 3) for r in with_efficiency([_row(2, 20.0), _row(4, 36.0)])] == [1.0, 0.9]
    save_rows(rows, tmp_path / "scaling.csv")
    assert load_rows(tmp_path / "scaling.csv") == rows


def test_auto_load_processes_follow_the_user_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    args = argparse.Namespace(processes="auto", users_per_replica=10, arrival_rate_per_replica=0.0)
    assert [load_processes_for(args, n) for n in (1, 8, 10, 16, 64)] == [1, 1, 1, 2, 4]
    assert load_processes_for(argparse.Namespace(processes="3"), 1) == 3


def test_no_request_or_an_efficiency_past_the_ceiling_is_nonsense() -> None:
    assert nonsense(with_efficiency([_row(1, 10.0), _row(2, 19.0)])) == []
    assert nonsense(with_efficiency([_row(1, 10.0), _row(2, 23.0)])) == ["2 replicas: efficiency 1.150 > 1.1"]
    assert nonsense(with_efficiency([_row(1, 0.0), _row(2, 19.0)]))[0].startswith("1 replicas: ")
