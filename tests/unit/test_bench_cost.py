"""`dpserve bench cost`'s arithmetic: targets named on the command line, ABBA order, ratios within rounds, the
goals (CPU and hit rate), and the figures it refuses."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.cost import Row, Target, nonsense, order, verdicts


def row(round_index: int, target: str, cpu_us: float, hit: float = 0.9, errors: int = 0) -> Row:
    return Row(round_index, target, 100, errors, 1.0, 100.0, cpu_us / 1e4, cpu_us, hit)


def test_targets_are_parsed_and_labelled() -> None:
    assert Target.parse("dpserve:kv_aware+tokenizer") == Target("dpserve", "kv_aware", tokenizer=True)
    assert Target.parse("dpserve@abc123:least_loaded").label == "dpserve@abc123:least_loaded"
    for bad in ("vllm-router@abc:round_robin", "nginx:round_robin", "dpserve:", "vllm-router:x+tokenizer"):
        with pytest.raises(argparse.ArgumentTypeError):
            Target.parse(bad)


def test_rounds_alternate_their_order() -> None:
    targets = [Target.parse(t) for t in ("dpserve:kv_aware", "vllm-router:cache_aware")]
    assert order(targets, 0) == targets and order(targets, 1) == targets[::-1] and order(targets, 2) == targets


def test_goals_are_medians_of_ratios_within_rounds_and_need_the_hit_rate_too() -> None:
    rows = [
        row(0, "dpserve:kv_aware", 900),
        row(0, "vllm-router:cache_aware", 1000),
        row(1, "dpserve:kv_aware", 2400),  # a slow round for both: the ratio holds
        row(1, "vllm-router:cache_aware", 2000),
        row(2, "dpserve:kv_aware", 950),
        row(2, "vllm-router:cache_aware", 1000),
    ]
    [(line, met)] = verdicts(rows)
    assert "0.95x" in line and met
    worse_hits = [
        row(r.round, r.target, r.cpu_us_per_request, 0.5 if r.target.startswith("dpserve") else 0.9) for r in rows
    ]
    [(_, met)] = verdicts(worse_hits)
    assert not met  # cheaper, but fewer hits: not met
    dearer = [
        row(r.round, r.target, r.cpu_us_per_request * (1.2 if r.target.startswith("dpserve") else 1)) for r in rows
    ]
    [(line, met)] = verdicts(dearer)
    assert "1.14x" in line and not met


def test_nonsense_is_refused() -> None:
    assert nonsense([row(0, "dpserve:kv_aware", 900)]) == []
    assert nonsense([row(0, "dpserve:kv_aware", 900, errors=3)])
    assert nonsense([row(0, "dpserve:kv_aware", 0)])
