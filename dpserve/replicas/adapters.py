"""What one replica holds of LoRA adapters, from its own reports and the router's loads, unloads and
requests in flight; and reading vLLM's `vllm:lora_requests_info` for it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpserve.policies.adapters import AdapterSlots

LORA_INFO = "vllm:lora_requests_info"


@dataclass
class ReplicaAdapters:
    max_loras: int = 0
    """vLLM's `--max-loras` (from `vllm:lora_requests_info`); 0 while not known or LoRA is off."""
    loaded: set[str] = field(default_factory=set)
    """Adapters it serves: as its /v1/models last listed them, with the router's loads since."""
    loading: set[str] = field(default_factory=set)
    """Being loaded by the router now (also in `loaded`: requests may be sent there, after the load)."""
    active: frozenset[str] = frozenset()
    """Running or waiting on the replica, as its metrics last said (other clients' requests included)."""
    in_flight: dict[str, int] = field(default_factory=dict)
    """The router's requests in flight there, per adapter."""
    last_used: dict[str, float] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """Whether it serves adapters at all: it reported its LoRA slots, or lists an adapter."""
        return self.max_loras > 0 or bool(self.loaded)

    def slots(self, capacity: int = 0) -> AdapterSlots:
        """`capacity`: adapters it keeps loaded (`--lora-slots`; 0: the default per `max_loras`)."""
        busy = self.active | self.loading | {name for name, count in self.in_flight.items() if count > 0}
        loaded = frozenset(self.loaded)
        return AdapterSlots(self.max_loras, loaded, frozenset(busy), self.last_used, self.in_flight, capacity)

    def listed(self, names: Iterable[str]) -> None:
        """What its /v1/models says now (a restart empties it); loads in progress stay."""
        self.loaded = set(names) | self.loading
        for name in list(self.last_used):
            if name not in self.loaded:
                del self.last_used[name]

    def started(self, adapter: str, now: float) -> None:
        self.in_flight[adapter] = self.in_flight.get(adapter, 0) + 1
        self.last_used[adapter] = now

    def finished(self, adapter: str, now: float) -> None:
        left = self.in_flight.get(adapter, 0) - 1
        if left > 0:
            self.in_flight[adapter] = left
        else:
            self.in_flight.pop(adapter, None)
        if adapter in self.loaded:
            self.last_used[adapter] = now


def adapter_cards(cards: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The LoRA adapters among a replica's /v1/models cards (vLLM gives each a `parent`), by name."""
    return {
        str(card["id"]): card
        for card in cards
        if isinstance(card.get("parent"), str) and card.get("parent") and card["parent"] != card["id"]
    }


def lora_info(series: Sequence[tuple[dict[str, str], float]]) -> tuple[int, frozenset[str]] | None:
    """(max_loras, adapters running or waiting) from the samples of `vllm:lora_requests_info`. vLLM sets
    a sample's value to the time it logged it and keeps every label set it ever logged: the newest is now."""
    if not series:
        return None
    labels, _ = max(series, key=lambda sample: sample[1])
    max_lora = labels.get("max_lora", "")
    active = {
        name
        for key in ("running_lora_adapters", "waiting_lora_adapters")
        for name in labels.get(key, "").split(",")
        if name
    }
    return (int(max_lora) if max_lora.isdigit() else 0), frozenset(active)
