"""`--policy slo` as a pure function of a request's features and replica snapshots, and a request's SLO as
its headers and its tenant give it."""

from __future__ import annotations

import random

import pytest

from dpserve.policies import PrefixMatch, PrefixSource, ReplicaSnapshot, RequestFeatures, Slo, make_policy
from dpserve.policies.kv_aware import KvAware
from dpserve.policies.latency import ReplicaLatency
from dpserve.policies.least_loaded import LeastLoaded
from dpserve.policies.slo import SLO_CHANCE, SLO_UNMET, SloAware
from dpserve.router.flow.slo import slo_of, slo_unattainable
from dpserve.router.flow.tenants import TenantRules, parse_tenant_rules
from dpserve.router.http.errors import OpenAIError


def trained(per_k_tokens: float, fixed: float = 0.02, per_busy: float = 0.01) -> ReplicaLatency:
    """A replica's model after it learned its own line: seconds per 1000 tokens ahead, fixed, per request busy."""
    latency = ReplicaLatency()
    rng = random.Random(7)
    for _ in range(300):
        x = (1.0, rng.uniform(0, 3), rng.uniform(0, 3), float(rng.randrange(8)), 0.0)
        latency.ttft.learn(x, fixed + per_k_tokens * (x[1] + x[2]) + per_busy * x[3])
    return latency


def features(slo: Slo | None, prompt_tokens: int = 2000, cached: dict[str, int] | None = None) -> RequestFeatures:
    """A prompt of `prompt_tokens` in blocks of 16, `cached` blocks held per replica."""
    prefix = PrefixMatch(PrefixSource.KV_EVENTS, prompt_tokens // 16, 16, cached or {}, (11, 12), {}, prompt_tokens)
    return RequestFeatures("chat_completions", "m", True, prefix=prefix, slo=slo)


FAST, SLOW = trained(0.1), trained(0.5)  # 2000 uncached tokens: 0.22 s and 1.02 s


def test_a_request_with_an_slo_goes_to_a_replica_predicted_to_meet_it_over_a_cached_one() -> None:
    policy = SloAware(KvAware(random.Random(0)))
    fast, slow = ReplicaSnapshot("fast", latency=FAST), ReplicaSnapshot("slow", latency=SLOW)
    # The slow replica holds half the prompt: 1000 uncached there, 0.52 s; the fast one computes all, 0.22 s.
    request = features(Slo(0.3, None), cached={"slow": 62})
    assert policy.predict_ttft(request, slow) == pytest.approx(0.52, abs=0.02)
    assert policy.predict_ttft(request, fast) == pytest.approx(0.22, abs=0.02)
    decision = policy.choose(request, [slow, fast])
    assert (decision.id, decision.meets_slo) == ("fast", True)
    assert decision.ttft_s == pytest.approx(0.22, abs=0.02)
    assert decision.uncached_tokens == 2000
    # Without the SLO, kv_aware's own choice: the cache.
    assert policy.choose(features(None, cached={"slow": 62}), [slow, fast]).id == "slow"


def test_among_replicas_that_meet_it_the_inner_policy_chooses_by_cache() -> None:
    policy = SloAware(KvAware(random.Random(0)))
    one, two = ReplicaSnapshot("one", latency=FAST), ReplicaSnapshot("two", latency=FAST)
    decision = policy.choose(features(Slo(1.0, None), cached={"two": 100}), [one, two])
    assert (decision.id, decision.reason) == ("two", "cache_hit")
    assert decision.uncached_tokens == 2000 - 1600


def with_errors(latency: ReplicaLatency, errors: list[float]) -> ReplicaLatency:
    """The model, with these recent relative errors ((predicted - realized) / realized) seen."""
    made = ReplicaLatency()
    made.ttft, made.tpot = latency.ttft, latency.tpot
    made.errors.extend(errors)
    return made


def test_when_no_replica_can_meet_it_the_decision_says_so_on_the_nearest() -> None:
    policy = SloAware(LeastLoaded(random.Random(0)))
    exact = [0.0] * 50  # its predictions were right: 0.22 s will not come within 0.1 s
    fast, slow = ReplicaSnapshot("fast", latency=with_errors(FAST, exact)), ReplicaSnapshot("slow", latency=SLOW)
    decision = policy.choose(features(Slo(0.1, None)), [slow, fast])
    assert (decision.id, decision.reason, decision.meets_slo) == ("fast", SLO_UNMET, False)
    assert decision.ttft_s == pytest.approx(0.22, abs=0.02)


def test_one_predicted_just_late_goes_where_a_fair_share_of_such_answers_came_in_time() -> None:
    """Predictions err: of the fast replica's recent streams, 30% came in at half their prediction or
    sooner. A request predicted 0.22 s against a 0.15 s SLO has that chance there: sent, not refused."""
    policy = SloAware(LeastLoaded(random.Random(0)))
    errors = [1.0] * 30 + [0.0] * 70  # predicted twice the realized, 30 times of 100
    fast = ReplicaSnapshot("fast", latency=with_errors(FAST, errors))
    decision = policy.choose(features(Slo(0.15, None)), [ReplicaSnapshot("slow", latency=SLOW), fast])
    assert (decision.id, decision.reason, decision.meets_slo) == ("fast", SLO_CHANCE, True)
    assert fast.latency.chance_within(0.15, 0.22) == 0.3
    assert not policy.choose(features(Slo(0.05, None)), [fast]).meets_slo  # 4.4x late: no answer came that soon
    assert ReplicaLatency().chance_within(0.1, 1.0) == 0.5  # nothing seen yet: not refused on the prior alone


def test_load_ahead_on_a_replica_counts_against_it() -> None:
    policy = SloAware(LeastLoaded(random.Random(0)))
    busy_latency = trained(0.1)
    busy_latency.sent(6000, slo_bound=False)  # 6000 tokens sent there, not yet answering: 0.6 s more
    busy, slow = ReplicaSnapshot("busy", in_flight=1, latency=busy_latency), ReplicaSnapshot("slow", latency=SLOW)
    assert policy.choose(features(Slo(1.1, None)), [busy, slow]).id == "slow"


def test_served_first_best_effort_queued_ahead_does_not_count() -> None:
    """Where the replicas serve SLO requests first (--vllm-priority), best effort waiting there is no reason
    to go elsewhere."""
    queued = trained(0.1)
    for _ in range(6):
        queued.sent(1000, slo_bound=False)  # 6000 best-effort tokens waiting, 6 queued past 2 slots
    crowded = ReplicaSnapshot("crowded", in_flight=6, capacity=2, latency=queued)
    request = features(Slo(0.5, None))
    assert SloAware(LeastLoaded(random.Random(0))).predict_ttft(request, crowded) > 1.0
    first = SloAware(LeastLoaded(random.Random(0)), first=True)
    assert first.predict_ttft(request, crowded) == pytest.approx(0.22, abs=0.02)
    assert first.choose(request, [crowded]).meets_slo


def test_a_tpot_slo_filters_by_the_predicted_time_per_token() -> None:
    policy = SloAware(LeastLoaded(random.Random(0)))
    crowded, quiet = ReplicaLatency(), ReplicaLatency()
    for latency, per_token in ((crowded, 0.08), (quiet, 0.02)):
        for busy in range(10):
            latency.tpot.learn((1.0, float(busy)), per_token)
    replicas = [ReplicaSnapshot("crowded", latency=crowded), ReplicaSnapshot("quiet", in_flight=3, latency=quiet)]
    assert policy.choose(features(Slo(None, 0.05)), replicas).id == "quiet"  # though more loaded
    assert not policy.choose(features(Slo(None, 0.01)), replicas).meets_slo


def test_best_effort_goes_where_fewest_slo_bound_requests_are_within_the_guard() -> None:
    policy = SloAware(LeastLoaded(random.Random(0)))
    promised, free = ReplicaLatency(), ReplicaLatency()
    promised.sent(100, slo_bound=True)
    replicas = [ReplicaSnapshot("promised", in_flight=1, latency=promised), ReplicaSnapshot("free", in_flight=4)]
    assert policy.choose(features(None), replicas).id == "free"  # busier, but nothing promised there
    # Past the balance guard (1.5 x 1 + 8) the promised replica takes it after all.
    replicas[1] = ReplicaSnapshot("free", in_flight=10, latency=free)
    assert policy.choose(features(None), replicas).id == "promised"


def test_with_no_slo_anywhere_it_is_the_inner_policy_exactly() -> None:
    slo, plain = make_policy("slo"), LeastLoaded(random.Random(0))
    replicas = [ReplicaSnapshot(f"r{i}", in_flight=i % 3) for i in range(6)]
    for _ in range(20):
        assert slo.choose(features(None), replicas).id in {r.id for r in replicas if r.in_flight == 0}
    assert plain.choose(features(None), replicas).id in {"r0", "r3"}
    decision = slo.choose(features(None), replicas)
    assert decision.ttft_s > 0 and decision.ttft_inputs[0] == 1.0  # predicted, to learn from the answer


def test_slo_names_its_inner_policy_by_what_the_replicas_publish() -> None:
    from dpserve.policies import PolicyTuning

    assert isinstance(make_policy("slo", tuning=PolicyTuning(slo_inner="kv_aware")), SloAware)
    policy = make_policy("slo", tuning=PolicyTuning(slo_inner="kv_aware"))
    assert isinstance(policy, SloAware) and isinstance(policy.inner, KvAware)
    assert policy.needs == policy.inner.needs and policy.name == "slo"


def test_the_headers_give_the_slo_before_the_tenant_and_llm_d_names_are_accepted() -> None:
    rules = TenantRules(slo_ttft_s=0.5)
    assert slo_of({}, TenantRules()) is None
    assert slo_of({}, rules).ttft_s == 0.5  # type: ignore[union-attr]
    made = slo_of({"x-slo-ttft-ms": "300", "x-slo-tpot-ms": "40"}, rules)
    assert made is not None and (made.ttft_s, made.tpot_s, made.queue) == (0.3, 0.04, False)
    made = slo_of({"x-llm-d-slo-ttft-ms": "250"}, TenantRules(slo_queue=True))
    assert made is not None and (made.ttft_s, made.tpot_s, made.queue) == (0.25, None, True)


@pytest.mark.parametrize("value", ["0", "-5", "abc", "nan", "inf", "", "3600001"])
def test_a_bad_slo_header_is_a_400_naming_it(value: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        slo_of({"x-slo-ttft-ms": value}, TenantRules())
    assert refused.value.status == 400 and refused.value.param == "x-slo-ttft-ms"


def test_the_refusal_is_a_429_with_retry_after_and_says_why() -> None:
    error = slo_unattainable(Slo(0.3, None), 2.6)
    assert (error.status, error.code, error.type) == (429, "slo_unattainable", "rate_limit_error")
    assert error.headers["retry-after"] == "3"  # 2.3 s late, rounded up
    assert "300 ms" in error.message and "2600 ms" in error.message
    assert "router's queue" not in error.message
    waited = slo_unattainable(Slo(0.3, None), 0.5, waited_s=0.12)  # released from the queue, then predicted late
    assert "after 120 ms waiting in the router's queue" in waited.message


def test_tenant_rules_carry_a_default_slo() -> None:
    name, rules = parse_tenant_rules("acme:slo-ttft-ms=300,slo-tpot-ms=50,slo=queue")
    assert (name, rules.slo_ttft_s, rules.slo_tpot_s, rules.slo_queue) == ("acme", 0.3, 0.05, True)
    for bad in ("acme:slo-ttft-ms=0", "acme:slo=maybe", "acme:slo-tpot-ms=x"):
        with pytest.raises(ValueError, match="--tenant"):
            parse_tenant_rules(bad)
