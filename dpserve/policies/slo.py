"""SLO-aware: what the client was promised first, then cache and load as the inner policy weighs them.

A request with an SLO (`x-slo-ttft-ms`, `x-slo-tpot-ms`, or its tenant's) goes to one of the replicas
predicted to meet it (`policies/latency.py`: each replica's own learned model, with this request's uncached
tokens there, so a cached prefix counts as the shorter prefill it is), chosen among them by the inner
policy (kv_aware with KV events, else least_loaded). When none is predicted to meet it, it still goes to the
replica predicted nearest if a fair share of that replica's recent answers, predicted as late, came in time
(`FAIR_CHANCE`); otherwise the decision says so (`meets_slo` False, on the nearest): the router then
refuses it at once, or sends it anyway where its tenant says to queue.

Where the replicas serve requests with an SLO first (`first`: the router passes vLLM a `priority` one
ahead of the class's best effort, `--vllm-priority`, and they run `--scheduling-policy priority`), only
what is answering and the SLO-bound requests waiting there are ahead of one in the prediction.

A best-effort request (no SLO) goes where it slows SLO-bound requests least: among the replicas the
balance guard allows, those with the fewest SLO-bound requests in flight, so a fast replica that the
promised requests need is not filled with work that could wait; then the inner policy's pick. With no
SLO-bound request anywhere this is the inner policy exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpserve.policies.balance import BalanceGuard
from dpserve.policies.base import Decision, Policy, ReplicaView, RequestFeatures, Slo

SLO_UNMET = "slo_unmet"
"""The decision's reason when no candidate is predicted to meet the request's SLO."""
SLO_CHANCE = "slo_chance"
"""The decision's reason when none is predicted to meet it but the nearest has a fair chance (sent there)."""
FAIR_CHANCE = 0.25
"""A request none is predicted to meet is still sent when this share of the nearest replica's recent
streams, predicted as it is, would have come in time: predictions err, and a refused request is never
served in time (`dpserve bench slo`: refusing each group's cold first request, predicted just past 300 ms,
cost the policy goodput that kv_aware got)."""


class SloAware(Policy):
    name = "slo"

    def __init__(
        self, inner: Policy, guard: BalanceGuard | None = None, headroom: float = 1.0, first: bool = False
    ) -> None:
        """`headroom`: the share of an SLO a prediction must fit within (below 1 leaves room for error);
        `first`: the replicas serve requests with an SLO before best effort."""
        self.inner = inner
        self.needs = inner.needs
        self.sampling = inner.sampling
        self.guard = guard or BalanceGuard()
        self.headroom = headroom
        self.first = first

    def preferred(self, features: RequestFeatures, fleet: tuple[str, ...]) -> tuple[str, ...]:
        return self.inner.preferred(features, fleet)

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> Decision:
        slo = features.slo
        if slo is None:
            return self._predicted(features, self.inner.choose(features, self._spare(candidates)), candidates)
        meeting: list[ReplicaView] = []
        nearest: tuple[float, ReplicaView] | None = None
        for candidate in candidates:
            ttft = self.predict_ttft(features, candidate)
            if self.meets(slo, ttft, candidate):
                meeting.append(candidate)
            elif nearest is None or ttft < nearest[0]:
                nearest = (ttft, candidate)
        if meeting:
            return self._predicted(features, self.inner.choose(features, meeting), meeting)
        assert nearest is not None  # candidates are never empty
        ttft, replica = nearest
        inputs, uncached = self.ttft_inputs(features, replica)
        if self.worth_trying(slo, ttft, replica):
            return Decision(replica.id, SLO_CHANCE, ttft, inputs, uncached)
        return Decision(replica.id, SLO_UNMET, ttft, inputs, uncached, meets_slo=False)

    def worth_trying(self, slo: Slo, ttft: float, replica: ReplicaView) -> bool:
        """Predicted `ttft` there, the request meets its SLO, or has a fair chance to (`FAIR_CHANCE`)."""
        if self.meets(slo, ttft, replica):
            return True
        if slo.ttft_s is None or predict_tpot(replica) > (slo.tpot_s or math.inf) * self.headroom:
            return False
        return replica.latency.chance_within(slo.ttft_s * self.headroom, ttft) >= FAIR_CHANCE

    def meets(self, slo: Slo, ttft: float, replica: ReplicaView) -> bool:
        """Predicted `ttft` there, the request meets its SLO (with the headroom)."""
        limit = self.headroom
        if slo.ttft_s is not None and ttft > slo.ttft_s * limit:
            return False
        if slo.tpot_s is not None and predict_tpot(replica) > slo.tpot_s * limit:
            return False
        return True

    def _spare(self, candidates: Sequence[ReplicaView]) -> Sequence[ReplicaView]:
        """Candidates a best-effort request should go to: those the guard allows with the fewest SLO-bound
        requests in flight, when some carry more than others."""
        fewest = min(c.latency.slo_bound for c in candidates)
        if all(c.latency.slo_bound == fewest for c in candidates):
            return candidates
        spare = [c for c in self.guard.allowed(candidates) if c.latency.slo_bound == fewest]
        return spare or candidates

    def _predicted(self, features: RequestFeatures, inner: Decision, seen: Sequence[ReplicaView]) -> Decision:
        """The inner policy's decision, with the prediction at the replica it chose."""
        chosen = next(c for c in seen if c.id == inner.id)
        inputs, uncached = self.ttft_inputs(features, chosen)
        return Decision(inner.id, inner.reason, chosen.latency.predict_ttft(inputs), inputs, uncached)

    def ttft_inputs(
        self, features: RequestFeatures, replica: ReplicaView, when_free: bool = False
    ) -> tuple[tuple[float, ...], int]:
        """The TTFT model's inputs for this request on `replica`, and its uncached prompt tokens there
        (`when_free`: sent once one of its slots is free, none queued there)."""
        uncached = features.uncached_tokens(replica.id)
        first = self.first and features.slo is not None
        return replica.latency.ttft_inputs(uncached, replica.load, replica.capacity, first, when_free), uncached

    def predict_ttft(self, features: RequestFeatures, replica: ReplicaView, when_free: bool = False) -> float:
        """Seconds to this request's first token were it sent to `replica` now (or `when_free`)."""
        inputs, _ = self.ttft_inputs(features, replica, when_free)
        return replica.latency.predict_ttft(inputs)


def predict_tpot(replica: ReplicaView) -> float:
    """Seconds per output token for one more request decoding on `replica`."""
    latency = replica.latency
    return latency.tpot.predict(latency.tpot_inputs(replica.load))
