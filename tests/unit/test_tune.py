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
    assert ranked[0].ttft_mean_ms <= next(o for o in ranked if o.setting == DEFAULTS).ttft_mean_ms
    # Caring nothing for load and never guarding it piles the groups where their blocks are first seen.
    piled = replay(trace(groups=3, per_group=6, gap_s=0.05), FleetModel(("r0", "r1")), Setting(0, 0, 0, 100.0, 1000))
    assert piled.max_share > 1.0


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
