"""What a routing policy sees: a request's features and a snapshot of each candidate replica."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class PrefixSource(enum.Enum):
    """Where a request's prefix match comes from."""

    KV_EVENTS = "kv_events"
    """Token blocks the replicas reported caching (precise)."""
    ROUTED_TEXT = "routed_text"
    """Text chunks the router itself sent each replica (approximate)."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of the request's prompt each replica already holds, in blocks from the start."""

    source: PrefixSource
    total_blocks: int
    """Full blocks (KV blocks, or text chunks) in the prompt."""
    tokens_per_block: int
    matched: Mapping[str, int] = field(default_factory=dict)
    """Replica id -> leading blocks it holds (absent = 0)."""
    keys: tuple[int, ...] = ()
    """The blocks' chained keys, for recording where the prompt went."""
    held: Mapping[str, int] = field(default_factory=dict)
    """Replica id -> blocks it holds in all (from the index): how much of the fleet's cached prefixes it
    already owns, so a new prefix can go where there is least."""

    def blocks(self, replica_id: str) -> int:
        return self.matched.get(replica_id, 0)

    @property
    def best(self) -> int:
        return max(self.matched.values(), default=0)


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    endpoint: str
    model: str
    stream: bool
    prefix: PrefixMatch | None = None
    """Filled only for policies that use it (see `Policy.needs`)."""
    session_key: str | None = None
    """`x-session-id` header, else the body's `user`; filled only for policies that use it."""


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


@dataclass(frozen=True, slots=True)
class Decision:
    id: str
    """The chosen replica."""
    reason: str
    """Why, for the `dpserve_routing_decisions_total{policy,reason}` metric (a small fixed set per policy)."""


class Need(enum.Enum):
    KV_PREFIX = "kv_prefix"
    TEXT_PREFIX = "text_prefix"
    SESSION = "session"


class Policy(Protocol):
    name: str
    needs: frozenset[Need]
    """Which request features the router must compute for this policy (the rest stay empty)."""

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaSnapshot]) -> Decision:
        """Pick one of `candidates` (never empty, all healthy and serving the model)."""
        ...


def least_loaded_of(candidates: Sequence[ReplicaSnapshot]) -> list[ReplicaSnapshot]:
    """The candidates sharing the lowest load, and among those the emptiest KV cache."""
    best = min(c.load for c in candidates)
    tied = [c for c in candidates if c.load == best]
    if len(tied) > 1:
        least_kv = min(c.kv_usage for c in tied)
        tied = [c for c in tied if c.kv_usage <= least_kv + 1e-9]
    return tied
