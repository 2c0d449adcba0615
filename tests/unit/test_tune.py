"""`dpserve tune`: reading a receipts log, replaying it in the fleet model, ranking settings (no sockets)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dpserve.kvindex.index import block_keys
from dpserve.sim.engine import LatencyModel
from dpserve.tune.command import fleet_timing, main
from dpserve.tune.replay import DEFAULTS, FleetModel, Setting, TraceRequest, grid, read_receipts, replay, tune
from dpserve.tune.timing import TimedAnswer, fit_timing

BS = 16


def trace(groups: int, per_group: int, gap_s: float) -> list[TraceRequest]:
    """Groups of prompts sharing 20 blocks, each with 2 blocks of its own, arriving in turn."""
    requests = []
    for index in range(groups * per_group):
        group = index % groups
        tokens = [100_000 * (group + 1) + t for t in range(20 * BS)] + [7 * index + t for t in range(2 * BS)] + [1]
        keys = tuple(block_keys(tokens, BS))
        requests.append(TraceRequest(index * gap_s, keys, BS, len(tokens), 8))
    return requests


def receipt_line(request: TraceRequest, replica: str) -> str:
    return json.dumps(
        {
            "at": 1000 + request.at,
            "replica": replica,
            "block_tokens": request.block_tokens,
            "prompt_tokens": request.prompt_tokens,
            "completion_tokens": request.completion_tokens,
            "keys": list(request.keys),
        }
    )


def test_receipts_are_read_oldest_first_and_those_without_blocks_skipped() -> None:
    requests = trace(2, 2, 0.5)
    lines = [receipt_line(requests[1], "r1"), receipt_line(requests[0], "r0"), json.dumps({"at": 1, "replica": "r2"})]
    read, replicas = read_receipts(["", *lines])
    assert [r.keys for r in read] == [r.keys for r in requests[:2]] and [r.at for r in read] == [1000.0, 1000.5]
    assert replicas == ["r0", "r1", "r2"]
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_receipts(["{}", "nope"])
    # A line without its time is refused as such, not with a KeyError.
    bad = json.loads(lines[0])
    del bad["at"]
    with pytest.raises(ValueError, match="line 1 is not a receipt"):
        read_receipts([json.dumps(bad)])


def test_the_model_hits_what_a_partition_would_and_the_defaults_are_among_the_settings() -> None:
    requests = trace(groups=4, per_group=6, gap_s=0.05)
    fleet = FleetModel(("r0", "r1", "r2", "r3"), kv_blocks=0, latency=LatencyModel(0.0001, 0.01, 0.02))
    outcome = replay(requests, fleet, DEFAULTS)
    # Each group's 20 shared blocks computed once: 5 of 6 prompts hit them (the 2 own blocks never hit).
    assert outcome.hit_rate == pytest.approx(4 * 5 * 20 * BS / sum(r.prompt_tokens for r in requests))
    assert outcome.max_share == 1.0  # kv_aware spread the four new groups over the four replicas
    assert replay(requests, fleet, DEFAULTS) == outcome  # deterministic
    settings = grid()
    assert DEFAULTS in settings and len(set(settings)) == len(settings)
    ranked = tune(requests, fleet, settings)
    # The defaults already partition the groups: settings that tie with them rank below them (no change
    # without a gain).
    assert ranked[0].setting == DEFAULTS and ranked[1].ttft_mean_ms == ranked[0].ttft_mean_ms
    # Caring nothing for load and never guarding it piles the groups where their blocks are first seen.
    piled = replay(trace(groups=3, per_group=6, gap_s=0.05), FleetModel(("r0", "r1")), Setting(0, 0, 0, 100.0, 1000))
    assert piled.max_share > 1.0


def burst(requests: int, gap_s: float) -> list[TraceRequest]:
    """One group's prompts (20 shared blocks, 2 of their own and a token), arriving together and answered
    at length (100 tokens at 10 ms: all still running when the last arrives)."""
    out = []
    for index in range(requests):
        tokens = [100_000 + t for t in range(20 * BS)] + [7 * index + t for t in range(2 * BS)] + [1]
        out.append(TraceRequest(index * gap_s, tuple(block_keys(tokens, BS)), BS, len(tokens), 100))
    return out


def test_a_burst_on_one_prefix_is_tuned_to_the_loosest_guard_not_the_defaults() -> None:
    # 16 requests of one group in flight at once on 2 replicas, and no batch slowdown: a request's time to
    # first token is its uncached tokens x 0.1 ms, so the fewer recomputed prefixes, the better. The
    # default guard (1.5 x the lightest load + 8) moves the 10th request off the group's replica (load 9),
    # which then recomputes the 20 shared blocks; only the loosest guard (2 x + 16) keeps all 16 on it,
    # and only while the load weight keeps 15 in flight under the cost of a whole prompt (15 x w < 1).
    requests = burst(16, gap_s=0.001)
    fleet = FleetModel(("r0", "r1"), latency=LatencyModel(0.0001, 0.01, 0.0))
    ranked = tune(requests, fleet, grid())
    defaults = next(o for o in ranked if o.setting == DEFAULTS)
    prompt = 16 * (22 * BS + 1)
    assert defaults.hit_rate == pytest.approx(14 * 20 * BS / prompt)  # the first and the 10th miss
    assert defaults.ttft_mean_ms == pytest.approx((2 * 35.3 + 14 * 3.3) / 16)
    best = ranked[0]
    assert best.hit_rate == pytest.approx(15 * 20 * BS / prompt)  # only the first misses
    assert best.ttft_mean_ms == pytest.approx((35.3 + 15 * 3.3) / 16)
    tied = {o.setting for o in ranked if round(o.ttft_mean_ms, 1) == round(best.ttft_mean_ms, 1)}
    assert tied == {s for s in grid() if (s.balance_rel, s.balance_abs) == (2.0, 16) and s.load_weight <= 0.05}, (
        "the settings tied for best are those that never spill the burst"
    )
    assert DEFAULTS not in tied


def test_the_command_recommends_the_setting_that_wins_not_the_defaults(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "receipts.jsonl"
    log.write_text("\n".join(receipt_line(r, f"r{i % 2}") for i, r in enumerate(burst(16, gap_s=0.001))) + "\n")
    flags = ["--receipts", str(log), "--prefill-ms-per-token", "0.1", "--decode-ms-per-token", "10"]
    assert main([*flags, "--batch-slowdown", "0"]) == 0
    out = capsys.readouterr().out
    assert "no setting tried does better than the defaults" not in out
    assert "\nbest: --kv-load-weight 0 --kv-cache-weight 0 --kv-held-weight 0 --balance-rel 2 --balance-abs 16\n" in out
    assert "expected: hit rate 0.850 (defaults 0.793), TTFT mean 5.3 ms (defaults 7.3 ms)" in out


def test_the_command_prints_the_best_flags_and_the_defaults(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "receipts.jsonl"
    requests = trace(groups=3, per_group=4, gap_s=0.02)
    log.write_text("\n".join(receipt_line(r, f"r{i % 2}") for i, r in enumerate(requests)) + "\n")
    assert main(["--receipts", str(log), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("12 requests over 0.2 s, 2 replicas")
    assert "defaults" in out and "\nbest: --kv-load-weight " in out and "expected: hit rate " in out
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"at": 1, "replica": "r0"}) + "\n")
    assert main(["--receipts", str(empty)]) == 2
    assert "has no receipts with prompt blocks" in capsys.readouterr().err


def test_the_fleets_timing_is_fitted_to_the_receipts_times() -> None:
    # Answers timed as 2 ms + 0.05 ms a computed prompt token + 8 ms an output token, with a little noise.
    answers = [
        TimedAnswer(computed, generated, 0.002 + 0.00005 * computed + 0.008 * generated + noise)
        for computed, generated, noise in [
            (1000, 4, 0.0004),
            (30, 8, -0.0003),
            (500, 2, 0.0002),
            (1500, 16, -0.0001),
            (60, 4, 0.0003),
            (800, 12, -0.0004),
            (20, 2, 0.0001),
            (1200, 6, -0.0002),
        ]
    ]
    fitted = fit_timing(answers)
    assert fitted is not None and fitted.requests == 8
    assert fitted.prefill_s_per_token == pytest.approx(0.00005, rel=0.05)
    assert fitted.decode_s_per_token == pytest.approx(0.008, rel=0.05)
    assert fitted.overhead_s == pytest.approx(0.002, abs=0.001)
    assert fit_timing(answers[:7]) is None  # too few to say
    # Every answer the same length: the decode term cannot be told from the overhead, so it is not fitted.
    same_length = [TimedAnswer(a.computed_tokens, 4, 0.002 + 0.00005 * a.computed_tokens) for a in answers]
    flat = fit_timing(same_length)
    assert flat is not None and flat.decode_s_per_token is None
    assert flat.prefill_s_per_token == pytest.approx(0.00005)


def test_tune_times_the_replay_as_given_else_as_the_receipts_say_else_as_the_simulator() -> None:
    timed = [
        TraceRequest(i * 0.1, (i,), BS, 100 + 50 * i, 2 + i % 3, 0, seconds=0.01 + 0.0002 * (100 + 50 * i))
        for i in range(10)
    ]
    prefill, decode, line = fleet_timing(timed, None, 20.0)
    assert prefill == pytest.approx(0.0002, rel=0.01) and decode == 0.02
    assert line == "timing: prefill 0.2 ms/token (fitted to 10 receipts' times), decode 20 ms/token (given)"
    untimed = [replace(r, seconds=None) for r in timed]
    assert fleet_timing(untimed, None, None)[2] == (
        "timing: prefill 0.1 ms/token (the simulator's default), decode 10 ms/token (the simulator's default)"
    )
