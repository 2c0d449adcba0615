"""`dpserve bench elastic`'s arithmetic (no sockets): the day's shape, replica-minutes from the census, when a
replica was first seen in a state, TTFT by part of the day, the goal lines and the checks that stop nonsense."""

from __future__ import annotations

import math

import pytest

from benchmarks.elastic import DAY, Census, Run, by_phase, check, figures, rate_at, verdicts
from benchmarks.streamed import Reply


def reply(start: float, ttft_s: float, code: str = "") -> Reply:
    return Reply(start, start + 1.0, ttft_s, 200 if not code else 503, code, 1, "")


def test_the_day_is_night_ramp_peak_fall_night() -> None:
    assert DAY[0] == (0.0, 0.1) and DAY[-1] == (1.0, 0.1)
    assert rate_at(0.1, 20.0) == pytest.approx(2.0)  # night: a tenth of the peak
    assert rate_at(0.3, 20.0) == pytest.approx(11.0)  # half way up the ramp
    assert rate_at(0.5, 20.0) == pytest.approx(20.0)
    assert rate_at(0.7, 20.0) == pytest.approx(11.0)
    assert rate_at(0.9, 20.0) == pytest.approx(2.0)


def test_replica_minutes_count_every_registered_replica_over_time() -> None:
    census = Census(samples=[(0.0, {"r0": "healthy"}), (30.0, {"r0": "healthy", "r1": "starting"}),
                             (90.0, {"r0": "healthy", "r1": "draining"}), (120.0, {"r0": "healthy"})])  # fmt: skip
    # 1 replica for 30 s, 2 for 60 s, 2 for 30 s: 210 replica-seconds.
    assert census.replica_minutes() == pytest.approx(3.5)
    assert census.most() == 2 and census.count_now() == 1
    assert census.first("r1", "draining") == 90.0 and census.first("r1", "healthy") is None
    assert census.first("r0", "healthy", after=50.0) == 90.0


def test_ttft_figures_and_their_parts_of_the_day() -> None:
    replies = [reply(5.0, 0.01), reply(25.0, 0.5), reply(50.0, 0.02), reply(51.0, 0.0, code="http_503")]
    requests, failed, p50, p99 = figures(replies)
    assert (requests, failed, p50, p99) == (4, 1, 20.0, 500.0)
    assert (
        by_phase(replies, 100.0) == "TTFT p99 by part of the day (ms): night 10, ramp 500, peak 20, fall nan, night nan"
    )


def run(fleet: str, minutes: float, p99: float, failed: int = 0, ups: int = 0) -> Run:
    return Run("sim", fleet, 300.0, 1000, failed, 20.0, p99, minutes, 4, ups, 0)


def test_the_goal_lines_compare_the_elastic_fleet_with_the_fixed_one() -> None:
    lines = verdicts([run("fixed", 20.0, 100.0), run("elastic", 12.0, 115.0, ups=3)])
    assert "0.60x (goal <= 0.7x): met" in lines[0]
    assert "1.15x (goal <= 1.2x): met" in lines[1]
    assert "failed 0 of 1000 elastic" in lines[2] and lines[2].endswith("met")
    worse = verdicts([run("fixed", 20.0, 100.0), run("elastic", 15.0, 130.0, failed=2, ups=3)])
    assert all("NOT met" in line for line in worse)


def test_a_repeated_day_counts_the_days_that_met_every_goal() -> None:
    good, slow = run("elastic", 12.0, 115.0, ups=3), run("elastic", 12.0, 125.0, ups=3)
    lines = verdicts([run("fixed", 20.0, 100.0), good, run("fixed", 20.0, 100.0), slow])
    assert "- sim days meeting every goal: 1 of 2" in lines
    assert "1.25x (goal <= 1.2x): NOT met" in lines[4]
    assert not any("meeting every goal" in line for line in verdicts([run("fixed", 20.0, 100.0), good]))


def test_nonsense_stops_the_run() -> None:
    check([run("fixed", 20.0, 100.0), run("elastic", 12.0, 110.0, ups=1)])
    with pytest.raises(RuntimeError, match="never scaled up"):
        check([run("elastic", 12.0, 110.0, ups=0)])
    with pytest.raises(RuntimeError, match="implausible"):
        check([run("fixed", 0.0, 100.0)])
    with pytest.raises(RuntimeError, match="implausible"):
        check([run("fixed", 10.0, math.nan)])
