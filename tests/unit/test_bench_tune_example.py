"""benchmarks/tune_example.py's pure parts: the seeded workload (12 system prompts, 4 clients x 30 requests, 2 to
16 output tokens), the figures read from a receipts log and from `dpserve tune`'s output, the timing fit's errors,
and the checks that fail the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.tune_example import (
    ChatRequest,
    LogFigures,
    checks,
    fit_figures,
    log_figures,
    shown_command,
    tune_defaults_hit_rate,
    tune_request_count,
    workload,
)
from dpserve.tune.replay import TraceRequest

TUNE_OUTPUT = """120 requests over 7.4 s, 2 replicas, KV cache unbounded blocks each; 216 settings of kv_aware tried
timing: prefill 0.0179 ms/token (fitted to 120 receipts' times), decode 6.145 ms/token (fitted to 120 receipts' times)
          load w  cache w  held w  guard   hit rate  TTFT mean ms  p50 ms  p99 ms  max share
#1        0.05    0.2      1       1.5+8   0.762     3.5           2.8     15.2    1.03
defaults  0.05    0.2      1       1.5+8   0.761     3.5           2.8     15.2    1.03

best: --kv-load-weight 0.05 --kv-cache-weight 0.2 --kv-held-weight 1 --balance-rel 1.5 --balance-abs 8
"""


def test_the_default_workload_is_4_clients_of_30_requests_over_12_system_prompts() -> None:
    plan = workload()
    assert [len(requests) for requests in plan] == [30, 30, 30, 30]
    flat = [request for requests in plan for request in requests]
    assert all(request.client == client for client, requests in enumerate(plan) for request in requests)
    assert all([r.number for r in requests] == list(range(30)) for requests in plan)
    systems = {request.messages[0] for request in flat}
    assert len(systems) == 12 and {request.system for request in flat} == set(range(12))
    assert all(role == "system" and len(text.split()) == 3 + 250 for role, text in systems)
    questions = [request.messages[1] for request in flat]
    assert len(set(questions)) == 120 and all(role == "user" for role, _ in questions)
    tokens = [request.max_tokens for request in flat]
    assert min(tokens) == 2 and max(tokens) == 16 and all(2 <= t <= 16 for t in tokens)
    # Each request carries the system prompt its index names.
    by_index = {request.system: request.messages[0] for request in flat}
    assert all(by_index[request.system] == request.messages[0] for request in flat)


def test_the_workload_is_the_same_for_a_seed_and_another_for_another_seed() -> None:
    assert workload(seed=3) == workload(seed=3)
    assert workload(seed=3) != workload(seed=4)
    small = workload(seed=1, clients=2, per_client=5, systems=3, system_words=10, min_tokens=4, max_tokens=4)
    assert [len(requests) for requests in small] == [5, 5]
    assert all(r.max_tokens == 4 and r.system < 3 for requests in small for r in requests)
    with pytest.raises(ValueError):
        workload(min_tokens=5, max_tokens=4)


def test_a_request_body_asks_for_exactly_its_output_tokens() -> None:
    request = ChatRequest(0, 0, 1, (("system", "s"), ("user", "q")), 7)
    assert request.body("tiny") == {
        "model": "tiny",
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        "max_tokens": 7,
        "ignore_eos": True,
        "temperature": 0,
    }


def receipt(replica: str, verdict: str, prompt: int | None, predicted: int, realized: int, completion: int) -> str:
    return json.dumps(
        {
            "replica": replica,
            "class": verdict,
            "prompt_tokens": prompt,
            "predicted_cached_tokens": predicted,
            "realized_cached_tokens": realized,
            "completion_tokens": completion,
        }
    )


def test_log_figures_count_receipts_classes_and_the_realized_hit_rate() -> None:
    lines = [
        receipt("r0", "cold", 100, 0, 0, 2),
        receipt("r1", "hit", 100, 64, 80, 16),
        "",
        receipt("r0", "hit", 200, 96, 96, 5),
        receipt("r1", "unscored", None, 0, 0, 0),  # an error: counted, no tokens
    ]
    figures = log_figures(lines)
    assert figures.receipts == 4
    assert figures.classes == {"cold": 1, "hit": 2, "unscored": 1}
    assert figures.per_replica == {"r0": 2, "r1": 2}
    assert figures.prompt_tokens == 400 and figures.mean_prompt_tokens == pytest.approx(400 / 3)
    assert figures.realized_hit_rate == pytest.approx(176 / 400)
    assert figures.predicted_hit_rate == pytest.approx(160 / 400)
    assert figures.completion_tokens == [2, 16, 5]
    assert log_figures([]).realized_hit_rate == 0.0


def test_the_fit_figures_are_tunes_fit_and_its_errors_per_answer() -> None:
    # Times made exactly as 20 ms + 0.05 ms a computed token + 5 ms an output token: no error.
    requests = [
        TraceRequest(
            i, (1,), 16, 800, 2 + i % 15, 16 * (i % 7), 0.020 + 0.00005 * (800 - 16 * (i % 7)) + 0.005 * (2 + i % 15)
        )
        for i in range(40)
    ]
    fit = fit_figures(requests)
    assert fit is not None and fit.answers == 40
    assert fit.prefill_ms_per_token == pytest.approx(0.05) and fit.decode_ms_per_token == pytest.approx(5)
    assert fit.overhead_ms == pytest.approx(20) and fit.mean_abs_error_ms == pytest.approx(0, abs=1e-6)
    assert fit.mean_ms == pytest.approx(1000 * sum(r.seconds or 0 for r in requests) / 40)
    # One answer 30 ms slower than the rest: a mean error, a median error near none.
    slower = [*requests[:-1], TraceRequest(40, (1,), 16, 800, 2, 0, (requests[-1].seconds or 0) + 0.030)]
    noisy = fit_figures(slower)
    assert noisy is not None and noisy.mean_abs_error_ms > noisy.median_abs_error_ms
    # Too few timed answers (or none timed) fit nothing.
    assert fit_figures(requests[:5]) is None
    assert fit_figures([TraceRequest(i, (1,), 16, 800, 4) for i in range(40)]) is None


def test_tunes_output_gives_the_requests_replayed_and_the_defaults_hit_rate() -> None:
    assert tune_request_count(TUNE_OUTPUT) == 120
    assert tune_defaults_hit_rate(TUNE_OUTPUT) == 0.761
    assert tune_request_count("") is None and tune_defaults_hit_rate("") is None
    assert tune_request_count("dpserve tune: receipts.jsonl has no receipts") is None


def figures(receipts: int, prompt: int, realized: int, tokens: list[int]) -> LogFigures:
    return LogFigures(receipts, {"hit": receipts}, {"r0": receipts}, prompt, realized, realized, tokens, 800.0)


def test_the_checks_fail_on_missing_receipts_a_hit_rate_of_0_or_over_1_and_a_miscounted_replay() -> None:
    def failed(**changes: object) -> list[str]:
        values: dict[str, object] = {
            "sent": 120,
            "answered": 120,
            "log": figures(120, 1000, 700, [2, 16]),
            "replica_hit_rate": 0.7,
            "tune_requests": 120,
            "tune_hit_rate": 0.7,
            "min_tokens": 2,
            "max_tokens": 16,
        } | changes
        return [line for line, ok in checks(**values) if not ok]

    assert failed() == []
    assert failed(answered=119) == ["119 of 120 requests answered 200 (all)"]
    assert len(failed(log=figures(119, 1000, 700, [2, 16]))) == 1  # fewer receipts than requests
    assert failed(log=figures(121, 1000, 700, [2, 16])) == []  # more is fine (a retry's receipt)
    assert len(failed(log=figures(120, 1000, 0, [2, 16]))) == 1  # a hit rate of 0
    assert len(failed(log=figures(120, 1000, 1001, [2, 16]))) == 1  # over 1
    assert len(failed(log=figures(120, 1000, 700, [1, 16]))) == 1  # an answer shorter than asked
    assert len(failed(log=figures(120, 1000, 700, []))) == 1  # no answer's tokens at all
    assert len(failed(replica_hit_rate=None)) == 1 and len(failed(replica_hit_rate=1.2)) == 1
    assert len(failed(tune_requests=100)) == 1 and len(failed(tune_requests=None)) == 1
    assert len(failed(tune_hit_rate=0.0)) == 1 and len(failed(tune_hit_rate=None)) == 1


def test_a_shown_command_carries_no_machine_paths(tmp_path: Path) -> None:
    home = Path.home()
    command = [
        sys.executable,
        "-m",
        "dpserve",
        "up",
        "--run-dir",
        str(tmp_path / "run"),
        "--cache-dir",
        str(home / "c"),
    ]
    assert shown_command(command, tmp_path) == "python -m dpserve up --run-dir <work>/run --cache-dir ~/c"
