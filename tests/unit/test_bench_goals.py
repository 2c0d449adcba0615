"""The benchmarks' stated goals, checked on their own figures: each line says which it met and which not,
and the run exits non-zero when any is missed (no sockets: rows made here)."""

from __future__ import annotations

from benchmarks.policies import Row, verdicts


def row(workload: str, contender: str, hit_rate: float, oracle: float = 0.8, max_share: float = 1.0) -> Row:
    return Row("sim", workload, contender, 24, 0, hit_rate, oracle, round(hit_rate / oracle, 3), 1, 2, 3, max_share, "")


def test_policy_goals_are_met_only_when_kv_aware_is_near_the_oracle_above_round_robin_and_the_peers() -> None:
    good = [
        row("shared_prefix", "dpserve:kv_aware", 0.78),
        row("shared_prefix", "dpserve:round_robin", 0.3),
        row("shared_prefix", "vllm-router:cache_aware", 0.78),
        row("multi_turn", "dpserve:kv_aware", 0.7, oracle=0.7),
        row("multi_turn", "dpserve:round_robin", 0.2, oracle=0.7),
    ]
    assert verdicts(good) == [
        (
            "sim   shared_prefix   kv_aware/oracle 0.97 >= 0.95; vs round_robin 0.780 > 0.300; "
            "vs best vllm-router 0.780 >= 0.780; max share 1.00 <= 1.5",
            True,
        ),
        ("sim   multi_turn      kv_aware/oracle 1.00 >= 0.95; vs round_robin 0.700 > 0.200", True),
    ]
    # Each goal missed on its own turns its line false, and says which.
    under_oracle = [row("shared_prefix", "dpserve:kv_aware", 0.75), good[1], good[2]]
    assert verdicts(under_oracle)[0][1] is False and "kv_aware/oracle 0.94 NOT >= 0.95" in verdicts(under_oracle)[0][0]
    no_better = [good[0], row("shared_prefix", "dpserve:round_robin", 0.78), good[2]]
    assert verdicts(no_better)[0][1] is False and "vs round_robin 0.780 NOT > 0.780" in verdicts(no_better)[0][0]
    peer_ahead = [row("shared_prefix", "dpserve:kv_aware", 0.77), good[1], good[2]]
    assert verdicts(peer_ahead)[0][1] is False and "NOT >= 0.780" in verdicts(peer_ahead)[0][0]
    piled = [row("shared_prefix", "dpserve:kv_aware", 0.78, max_share=1.6), good[1], good[2]]
    assert verdicts(piled)[0][1] is False and "max share 1.60 NOT <= 1.5" in verdicts(piled)[0][0]
    # No kv_aware run: nothing is claimed.
    assert verdicts([good[1]]) == []
