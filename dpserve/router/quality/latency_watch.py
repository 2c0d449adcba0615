"""What the latency models learn from each answer, and whether each request got what it was promised.

A `LatencyWatch` follows one request whose policy predicts time (`policies/slo.py`): when it is sent, its
uncached prompt counts as work ahead on that replica (`ReplicaLatency.sent`) until its first byte; at a
stream's first event the replica's TTFT model learns from the time since the send, and the prediction's
error is observed; at a stream's end its TPOT model learns from the time per later token. A request with an
SLO is then counted by the `SloBook` as met (its first token within its TTFT SLO of reaching the router,
and its tokens within its TPOT SLO), missed, or refused (no replica was predicted to meet it).

A whole (non-streamed) answer reaches the client at once: its first token comes with the last, so its time
to the answer is what its TTFT SLO is held to, and no model learns from it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.policies.base import Decision, Slo
from dpserve.policies.latency import ReplicaLatency
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.http.errors import CLIENT_CLOSED
from dpserve.router.observe.life import Choice, RequestLife, Watch
from dpserve.router.observe.metrics import RouterMetrics

MET = "met"
MISSED = "missed"
REFUSED = "refused"
OUTCOMES = (MET, MISSED, REFUSED)
WINDOW_S = 60.0
"""Goodput and attainment in `/status` and the gauges are over the last minute."""


class SloBook:
    """Requests with an SLO by tenant, model and outcome (counters), and the last minute of them (goodput:
    requests that met their SLO per second; attainment: the share that did)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self._recent: dict[tuple[str, str], deque[tuple[float, str]]] = {}

    def count(self, tenant: str, model: str, outcome: str) -> None:
        self._metrics.slo_requests.add((tenant, model, outcome))
        recent = self._recent.get((tenant, model))
        if recent is None:
            recent = self._recent[(tenant, model)] = deque()
        now = time.monotonic()
        recent.append((now, outcome))
        while recent and recent[0][0] < now - WINDOW_S:
            recent.popleft()

    def prediction_error(self, replica_id: str, error_s: float) -> None:
        """Predicted less realized TTFT of one stream (seconds; above 0: the prediction was late)."""
        self._metrics.ttft_prediction_error.observe((replica_id,), error_s)

    def summary(self) -> list[dict[str, object]]:
        """Per tenant and model over the last minute: counts by outcome, goodput and attainment."""
        now = time.monotonic()
        rows: list[dict[str, object]] = []
        for (tenant, model), recent in sorted(self._recent.items()):
            seen = [outcome for at, outcome in list(recent) if at >= now - WINDOW_S]
            counts = {outcome: seen.count(outcome) for outcome in OUTCOMES}
            rows.append(
                {
                    "tenant": tenant,
                    "model": model,
                    **counts,
                    "goodput_rps": round(counts[MET] / WINDOW_S, 3),
                    "attainment": round(counts[MET] / len(seen), 4) if seen else None,
                }
            )
        return rows

    def attainment(self, model: str) -> float | None:
        """Share of the model's requests with an SLO (every tenant's) that met it over the last minute."""
        since = time.monotonic() - WINDOW_S
        seen = [
            outcome for (_, of), recent in self._recent.items() if of == model for at, outcome in recent if at >= since
        ]
        return seen.count(MET) / len(seen) if seen else None

    def watch(self, life: RequestLife, slo: Slo | None, registry: ReplicaRegistry) -> LatencyWatch:
        return LatencyWatch(self, life, slo, registry)


class SloCollector(Collector):
    """Goodput and attainment over the last minute, as gauges, read at scrape time."""

    def __init__(self, book: SloBook) -> None:
        self._book = book

    def collect(self) -> Iterator[Metric]:
        goodput = GaugeMetricFamily(
            "dpserve_slo_goodput",
            "Requests that met their SLO per second over the last minute, by tenant and model.",
            labels=["tenant", "model"],
        )
        attainment = GaugeMetricFamily(
            "dpserve_slo_attainment",
            "Share of requests with an SLO that met it over the last minute (refused ones included), by "
            "tenant and model.",
            labels=["tenant", "model"],
        )
        for row in self._book.summary():
            labels = [str(row["tenant"]), str(row["model"])]
            goodput.add_metric(labels, float(row["goodput_rps"]))  # type: ignore[arg-type]  # a number by construction
            if row["attainment"] is not None:
                attainment.add_metric(labels, float(row["attainment"]))  # type: ignore[arg-type]
        yield goodput
        yield attainment


class LatencyWatch(Watch):
    __slots__ = (
        "_book",
        "_decision",
        "_dispatched_at",
        "_first_at",
        "_latency",
        "_life",
        "_registry",
        "_replica_id",
        "_slo",
        "_waiting_first",
    )

    def __init__(self, book: SloBook, life: RequestLife, slo: Slo | None, registry: ReplicaRegistry) -> None:
        self._book = book
        self._life = life
        self._slo = slo
        self._registry = registry
        self._decision: Decision | None = None
        self._latency: ReplicaLatency | None = None
        """The model of the replica the current attempt went to."""
        self._replica_id = ""
        self._waiting_first = False
        """The current attempt's prompt counts as work ahead on its replica."""
        self._dispatched_at = 0.0
        self._first_at = 0.0

    def decided(self, choice: Choice) -> None:
        self._decision = choice.decision

    def dispatched(self, replica_id: str, at: float) -> None:
        self._end_attempt()  # a retry: the attempt before is over
        decision = self._decision
        replica = self._registry.find(replica_id)
        if decision is None or decision.id != replica_id or replica is None:
            return  # not sent by the policy's choice (a stored response's owner): nothing predicted
        self._latency, self._replica_id = replica.latency, replica_id
        self._latency.sent(decision.uncached_tokens, self._slo is not None)
        self._waiting_first, self._dispatched_at = True, at

    def first_byte(self, replica_id: str, at: float) -> None:
        latency, decision = self._latency, self._decision
        self._first_at = at
        if latency is None or decision is None or not self._waiting_first:
            return
        self._waiting_first = False
        latency.answering(decision.uncached_tokens, self._slo is not None)
        if not self._life.stream or not decision.ttft_inputs:
            return
        realized = at - self._dispatched_at
        predicted = decision.ttft_s
        self._book.prediction_error(replica_id, predicted - realized)
        latency.learn_ttft(decision.ttft_inputs, predicted, realized)

    def finished(self, life: RequestLife) -> None:
        latency = self._latency
        if latency is not None and life.stream and life.status == 200 and life.usage is not None:
            tokens = life.usage.completion_tokens
            if tokens > 1 and self._first_at > 0:
                busy = self._decision.ttft_inputs[3] if self._decision and self._decision.ttft_inputs else 0.0
                latency.tpot.learn((1.0, busy), (life.ended_at - self._first_at) / (tokens - 1))
        self._end_attempt()
        slo = self._slo
        if slo is not None:
            outcome = self._outcome(life, slo)
            if outcome is not None:
                self._book.count(life.tenant, life.model or "none", outcome)

    def _end_attempt(self) -> None:
        latency = self._latency
        if latency is None:
            return
        if self._waiting_first and self._decision is not None:
            latency.answering(self._decision.uncached_tokens, self._slo is not None)
        latency.done(self._slo is not None)
        self._latency, self._waiting_first = None, False

    def _outcome(self, life: RequestLife, slo: Slo) -> str | None:
        """Met, missed or refused; None for what says nothing of the SLO (a bad request, a client gone)."""
        decision = self._decision
        if life.refused:
            return REFUSED if decision is not None and not decision.meets_slo else None
        if life.status == CLIENT_CLOSED:
            return None
        if life.status != 200 or self._first_at <= 0:
            return MISSED
        if slo.ttft_s is not None and self._first_at - life.started > slo.ttft_s:
            return MISSED
        usage = life.usage
        if slo.tpot_s is not None and life.stream and usage is not None and usage.completion_tokens > 1:
            if (life.ended_at - self._first_at) / (usage.completion_tokens - 1) > slo.tpot_s:
                return MISSED
        return MET
