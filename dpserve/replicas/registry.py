"""The router's view of its replicas: identity, health, served models, load."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dpserve.gpu.placement import parse_replica_spec
from dpserve.policies.base import ReplicaSnapshot


@dataclass
class Replica:
    id: str
    url: str
    model_cards: tuple[dict[str, Any], ...] = ()
    """The replica's own /v1/models entries, kept so the router can list them while it is down."""
    models: tuple[str, ...] = ()
    """The cards' ids: what routing checks on every request. Set both through `set_model_cards`."""
    block_size: int | None = None
    healthy: bool = False
    in_flight: int = 0
    running: int = 0
    waiting: int = 0
    in_flight_at_scrape: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    last_error: str | None = None
    last_scrape: float | None = None
    served_total: int = 0
    gpu_hint: tuple[str, ...] = ()
    """GPU indices or UUIDs from `--replica URL@gpu=N` (the launcher gives them for replicas it starts)."""

    def set_model_cards(self, cards: tuple[dict[str, Any], ...]) -> None:
        self.model_cards = cards
        self.models = tuple(str(card["id"]) for card in cards)

    def snapshot(self) -> ReplicaSnapshot:
        return ReplicaSnapshot(
            id=self.id,
            in_flight=self.in_flight,
            running=self.running,
            waiting=self.waiting,
            in_flight_at_scrape=self.in_flight_at_scrape,
            kv_usage=self.kv_usage,
        )


def replica_ids(count: int) -> list[str]:
    """Ids in the order replicas were given: the launcher and the router agree on them."""
    return [f"r{index}" for index in range(count)]


class ReplicaRegistry:
    def __init__(self, specs: Sequence[str]) -> None:
        """`specs`: replica URLs, each optionally followed by `@gpu=N` (see `parse_replica_spec`)."""
        if not specs:
            raise ValueError("at least one replica URL is needed")
        self._replicas: dict[str, Replica] = {}
        for rid, spec in zip(replica_ids(len(specs)), specs, strict=True):
            url, hint = parse_replica_spec(spec)
            self._replicas[rid] = Replica(id=rid, url=url, gpu_hint=hint)

    def __iter__(self) -> Iterator[Replica]:
        return iter(self._replicas.values())

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, replica_id: str) -> Replica:
        return self._replicas[replica_id]

    def by_url(self, url: str) -> Replica | None:
        url = url.rstrip("/")
        return next((r for r in self._replicas.values() if r.url == url), None)

    def healthy(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.healthy]

    def served_models(self) -> list[str]:
        """Models of healthy replicas, de-duplicated, in replica order."""
        return list(self.model_cards(healthy_only=True))

    def known_models(self) -> list[str]:
        """Models any replica has ever reported, healthy now or not."""
        return list(self.model_cards(healthy_only=False))

    def model_cards(self, healthy_only: bool) -> dict[str, dict[str, Any]]:
        cards: dict[str, dict[str, Any]] = {}
        for replica in self._replicas.values():
            if healthy_only and not replica.healthy:
                continue
            for card in replica.model_cards:
                cards.setdefault(str(card["id"]), card)
        return cards

    def candidates(self, model: str, exclude: Iterable[str] = ()) -> list[ReplicaSnapshot]:
        excluded = set(exclude)
        return [
            r.snapshot() for r in self._replicas.values() if r.healthy and model in r.models and r.id not in excluded
        ]

    def acquire(self, replica_id: str) -> None:
        replica = self._replicas[replica_id]
        replica.in_flight += 1
        replica.served_total += 1

    def release(self, replica_id: str) -> None:
        replica = self._replicas[replica_id]
        replica.in_flight = max(0, replica.in_flight - 1)

    def mark_down(self, replica_id: str, reason: str) -> None:
        """Passive detection: a failed connection takes the replica out until a probe succeeds."""
        replica = self._replicas[replica_id]
        replica.healthy = False
        replica.last_error = reason

    def record_scrape(
        self,
        replica_id: str,
        *,
        running: int,
        waiting: int,
        kv_usage: float,
        prefix_cache_queries: float,
        prefix_cache_hits: float,
        block_size: int | None,
    ) -> None:
        replica = self._replicas[replica_id]
        replica.running = running
        replica.waiting = waiting
        replica.in_flight_at_scrape = replica.in_flight
        replica.kv_usage = kv_usage
        replica.prefix_cache_queries = prefix_cache_queries
        replica.prefix_cache_hits = prefix_cache_hits
        if block_size is not None:
            replica.block_size = block_size
        replica.last_scrape = time.monotonic()
