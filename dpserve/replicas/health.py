"""When a replica is in or out of routing: a pure state machine fed by probes and by real traffic.

- Active probes: `fail_threshold` failures in a row eject a replica; once ejected, `rise_threshold`
  successes in a row re-admit it. A replica never seen healthy is admitted on its first success, so
  a fleet starts serving at once.
- Passive signals from traffic: a refused connection ejects at once (nothing listens there); other
  failures (timeouts, dropped connections, 5xx) eject after `passive_fail_threshold` in a row. Any
  success resets the count. 4xx is the client's fault and never counts. Those softer signals never
  eject the last replica in routing (as Envoy's max ejection percent): a few requests that make a
  healthy engine fail must not take the whole service down; its probes still can.
- Backpressure (429, 503 with the replica still answering): the replica is not ejected but avoided
  for `backoff_s` while another replica can take the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class HealthRules:
    fail_threshold: int = 2
    rise_threshold: int = 2
    passive_fail_threshold: int = 3
    backoff_s: float = 1.0


class Outcome(Enum):
    """What one request told the router about a replica."""

    OK = "ok"
    CLIENT_ERROR = "client_error"  # 4xx other than 429: says nothing about the replica
    BACKPRESSURE = "backpressure"  # 429, or 503 from a replica that is answering
    SERVER_ERROR = "server_error"  # 5xx
    FAILED = "failed"  # timeout or connection dropped mid-request
    REFUSED = "refused"  # nothing accepted the connection


SOFT_FAILURES = frozenset({Outcome.SERVER_ERROR, Outcome.FAILED})
"""Counted towards passive ejection, which they never cause for the last replica standing."""


def classify_status(status: int) -> Outcome:
    if status in (429, 503):
        return Outcome.BACKPRESSURE
    if status >= 500:
        return Outcome.SERVER_ERROR
    if status >= 400:
        return Outcome.CLIENT_ERROR
    return Outcome.OK


@dataclass
class HealthState:
    healthy: bool = False
    ever_healthy: bool = False
    probe_failures: int = 0
    probe_successes: int = 0
    traffic_failures: int = 0
    backoff_until: float = 0.0
    ejected_at: float | None = None
    ejections: int = 0

    def backed_off(self, now: float) -> bool:
        return now < self.backoff_until


class HealthTracker:
    """Applies `HealthRules` to one replica's `HealthState`. Every method returns whether the replica's
    routability changed, so callers can log and count transitions."""

    def __init__(self, rules: HealthRules) -> None:
        self.rules = rules

    def probe_succeeded(self, state: HealthState) -> bool:
        state.probe_failures = 0
        state.probe_successes += 1
        if state.healthy:
            return False
        if state.ever_healthy and state.probe_successes < self.rules.rise_threshold:
            return False
        state.healthy = True
        state.ever_healthy = True
        state.traffic_failures = 0
        state.ejected_at = None
        return True

    def probe_failed(self, state: HealthState, now: float) -> bool:
        state.probe_successes = 0
        state.probe_failures += 1
        if state.healthy and state.probe_failures >= self.rules.fail_threshold:
            return self._eject(state, now)
        return False

    def succeeded(self, state: HealthState) -> None:
        """A request answered: the run of traffic failures is over."""
        state.traffic_failures = 0

    def observed(self, state: HealthState, outcome: Outcome, now: float, last_standing: bool = False) -> bool:
        """`last_standing`: no other replica is in routing."""
        if outcome is Outcome.OK:
            self.succeeded(state)
            return False
        if outcome is Outcome.CLIENT_ERROR:
            return False
        if outcome is Outcome.BACKPRESSURE:
            state.backoff_until = max(state.backoff_until, now + self.rules.backoff_s)
            return False
        if outcome is Outcome.REFUSED:
            return self._eject(state, now)
        state.traffic_failures += 1
        if state.traffic_failures >= self.rules.passive_fail_threshold and not last_standing:
            return self._eject(state, now)
        return False

    def _eject(self, state: HealthState, now: float) -> bool:
        state.probe_successes = 0
        state.traffic_failures = 0
        if not state.healthy:
            return False
        state.healthy = False
        state.ejected_at = now
        state.ejections += 1
        return True
