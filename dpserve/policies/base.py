"""What a routing policy sees: a request's features and a snapshot of each candidate replica."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    endpoint: str
    model: str
    stream: bool


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """A replica's state at the moment of one routing decision."""

    id: str
    in_flight: int = 0
    """Requests the router has dispatched to this replica and not yet seen finish (always fresh)."""
    running: int = 0
    waiting: int = 0
    """`vllm:num_requests_running` / `_waiting` from the last scrape (up to one interval old)."""
    in_flight_at_scrape: int = 0
    """The router's own in-flight count when that scrape answered."""
    kv_usage: float = 0.0

    @property
    def external_load(self) -> int:
        """Requests the replica reported beyond the router's own: traffic from other clients."""
        return max(0, self.running + self.waiting - self.in_flight_at_scrape)

    @property
    def load(self) -> int:
        # The router's fresh count plus what the replica holds for others; summing in_flight with the
        # raw scraped counts would count every routed request twice.
        return self.in_flight + self.external_load


class Policy(Protocol):
    name: str

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaSnapshot]) -> ReplicaSnapshot:
        """Pick one of `candidates` (never empty, all healthy and serving the model)."""
        ...
