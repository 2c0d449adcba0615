"""The per-replica latency model (`policies/latency.py`): an online least-squares fit that finds a replica's
own line, follows it when the replica changes speed, and starts from a prior."""

from __future__ import annotations

import random

from dpserve.policies.latency import TTFT_PRIOR, OnlineFit, ReplicaLatency


def _line(x: tuple[float, ...], weights: tuple[float, ...]) -> float:
    return sum(w * v for w, v in zip(weights, x, strict=True))


def _inputs(rng: random.Random) -> tuple[float, float, float, float, float]:
    return (1.0, rng.uniform(0, 2), rng.uniform(0, 4), float(rng.randrange(0, 16)), float(rng.randrange(0, 3)))


def test_the_fit_finds_a_replicas_own_line_through_noise() -> None:
    rng = random.Random(1)
    truth = (0.02, 0.3, 0.2, 0.01, 0.15)
    fit = ReplicaLatency().ttft
    for _ in range(400):
        x = _inputs(rng)
        fit.learn(x, _line(x, truth) * rng.uniform(0.95, 1.05))
    for _ in range(50):
        x = _inputs(rng)
        assert abs(fit.predict(x) - _line(x, truth)) <= 0.06 * _line(x, truth) + 0.005
    assert fit.samples == 400


def test_the_fit_follows_a_replica_that_slows_down() -> None:
    rng = random.Random(2)
    fit = ReplicaLatency().ttft
    fast, slow = (0.02, 0.1, 0.05, 0.005, 0.1), (0.06, 0.3, 0.15, 0.015, 0.3)
    for _ in range(300):
        x = _inputs(rng)
        fit.learn(x, _line(x, fast))
    probe = (1.0, 1.0, 2.0, 8.0, 1.0)
    assert abs(fit.predict(probe) - _line(probe, fast)) < 0.01
    for _ in range(600):  # a few forgetting half-lives later (each answer weighed by 1/its prediction: slower)
        x = _inputs(rng)
        fit.learn(x, _line(x, slow))
    assert abs(fit.predict(probe) - _line(probe, slow)) < 0.05 * _line(probe, slow)  # old answers weigh 5%


def test_the_prior_predicts_before_any_answer_and_a_few_answers_move_it() -> None:
    fit = ReplicaLatency().ttft
    x = (1.0, 1.0, 0.0, 0.0, 0.0)
    assert fit.predict(x) == TTFT_PRIOR[0] + TTFT_PRIOR[1]
    for _ in range(10):
        fit.learn(x, 0.9)
    assert abs(fit.predict(x) - 0.9) < 0.1  # ten answers outweigh the prior


def test_a_negative_slope_reads_as_none_and_a_prediction_is_never_below_zero() -> None:
    fit = OnlineFit((0.1, -0.5), (1.0, 1.0))
    assert fit.predict((1.0, 3.0)) == 0.1  # more work never makes a replica faster
    assert OnlineFit((-0.2, 0.0), (1.0, 1.0)).predict((1.0, 1.0)) == 0.0


def test_a_feature_that_never_varies_does_not_blow_up_when_it_starts_to() -> None:
    rng = random.Random(3)
    fit = ReplicaLatency().ttft
    for _ in range(2000):  # nothing queued ever: the queued weight's uncertainty would grow without bound
        x = (1.0, rng.uniform(0, 2), rng.uniform(0, 1), float(rng.randrange(4)), 0.0)
        fit.learn(x, 0.05 + 0.2 * x[1] + 0.1 * x[2] + 0.01 * x[3])
    x = (1.0, 1.0, 0.0, 2.0, 1.0)
    fit.learn(x, 0.05 + 0.2 + 0.02 + 0.3)
    assert 0.0 <= fit.predict((1.0, 1.0, 0.0, 2.0, 0.0)) < 0.5


def test_what_was_sent_counts_as_work_ahead_until_it_answers() -> None:
    latency = ReplicaLatency()
    latency.sent(800, slo_bound=True)
    latency.sent(200, slo_bound=False)
    assert (latency.prefill_tokens, latency.prefilling, latency.slo_bound) == (1000, 2, 1)
    # One more request of 500 uncached tokens on a replica with 5 requests and 4 slots:
    assert latency.ttft_inputs(500, 5, 4) == (1.0, 0.5, 1.0, 3.0, 2.0)
    latency.answering(800, slo_bound=True)
    latency.done(slo_bound=True)
    assert (latency.prefill_tokens, latency.prefilling, latency.slo_bound) == (200, 1, 0)
    latency.answering(200, slo_bound=False)
    latency.answering(200, slo_bound=False)  # never below nothing
    assert (latency.prefill_tokens, latency.prefilling) == (0, 0)
    assert latency.ttft_inputs(0, 0, 0) == (1.0, 0.0, 0.0, 0.0, 0.0)  # capacity unknown: nothing counted queued


def test_served_first_only_what_answers_and_the_slo_bound_waiting_are_ahead() -> None:
    """Where vLLM serves requests with an SLO first, one more with an SLO waits behind those answering and
    the SLO-bound ones not answering yet, not the best effort queued there."""
    latency = ReplicaLatency()
    for _ in range(4):
        latency.sent(100, slo_bound=False)
        latency.answering(100, slo_bound=False)  # 4 answering: the slots are full
    latency.sent(300, slo_bound=True)
    for _ in range(3):
        latency.sent(500, slo_bound=False)  # waiting, best effort
    # 8 requests on 4 slots: behind everything, 5 queued ahead of a ninth; served first, 1 (the SLO one).
    assert latency.ttft_inputs(200, 8, 4) == (1.0, 0.2, 1.8, 4.0, 5.0)
    assert latency.ttft_inputs(200, 8, 4, first=True) == (1.0, 0.2, 0.3, 4.0, 2.0)
    # Sent once a slot is free (after waiting in the router's queue): none queued ahead there.
    assert latency.ttft_inputs(200, 8, 4, when_free=True) == (1.0, 0.2, 1.8, 4.0, 0.0)
    latency.answering(300, slo_bound=True)
    assert (latency.slo_prefill_tokens, latency.slo_prefilling) == (0, 0)


def test_the_median_error_is_of_the_recent_answers() -> None:
    latency = ReplicaLatency()
    assert latency.median_error() is None
    for error in (0.5, -0.1, 0.05, 0.0, 0.1):
        latency.errors.append(error)
    assert latency.median_error() == 0.05


def test_under_a_long_tail_the_prediction_settles_on_the_median_answer() -> None:
    """Latencies under load: mostly near the line, now and then several times it. A least-squares line is
    their mean, above most answers; the calibration brings the prediction to where half come sooner."""
    rng = random.Random(4)
    latency = ReplicaLatency()
    truth = (0.02, 0.1, 0.05, 0.005, 0.0)
    sooner, errors = 0, []
    for n in range(1500):
        x = _inputs(rng)
        x = (*x[:4], 0.0)
        realized = _line(x, truth) * (rng.uniform(0.9, 1.1) if rng.random() < 0.7 else rng.uniform(2, 6))
        predicted = latency.predict_ttft(x)
        if n >= 500:
            sooner += realized < predicted
            errors.append(abs(predicted - realized) / realized)
        latency.learn_ttft(x, predicted, realized)
    assert 0.4 < sooner / 1000 < 0.6  # half the answers come sooner than predicted
    assert sorted(errors)[500] < 0.25
    assert latency.ttft_scale < 0.9  # below the mean's line
    assert len(latency.errors) == 256 and latency.median_error() is not None
