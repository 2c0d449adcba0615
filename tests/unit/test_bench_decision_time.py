"""The decision-time benchmark decides through the router's own Dispatcher for every policy and size."""

from __future__ import annotations

from benchmarks.decision_time import decision_report
from dpserve.policies import POLICY_NAMES


def test_every_policy_is_timed_at_every_size_and_judged() -> None:
    report = decision_report(counts=(2, 8, 16, 32), decisions=20, repeats=1)
    assert {(row["policy"], row["replicas"]) for row in report.rows} == {
        (policy, count) for policy in POLICY_NAMES for count in (2, 8, 16, 32)
    }
    assert all(row["us_per_decision"] > 0 for row in report.rows)
    verdict = report.text.splitlines()[-1]
    assert verdict.startswith("decision time flat from 16 to 32 replicas") and ("PASS" in verdict or "FAIL" in verdict)
