"""What the fleet serves: models and LoRA adapters, which replicas serve each, and the cards /v1/models
lists. Lookups read only memory (cached views, rebuilt when the registry's routability or a replica's models
change): the adapter folder is read by its own watch (`replicas/adapter_folder.py`), never here."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from dpserve.policies.adapters import AdapterSlots
from dpserve.policies.base import ReplicaView
from dpserve.replicas.adapters import adapter_cards
from dpserve.replicas.registry import Replica, ReplicaRegistry


def adapter_card(name: str, path: str, parent: str | None, parent_card: dict[str, Any] | None) -> dict[str, Any]:
    """An adapter's /v1/models card as vLLM writes one, for an adapter no replica has loaded yet."""
    created = parent_card.get("created") if parent_card else None
    return {
        "id": name,
        "object": "model",
        "created": created if isinstance(created, int) else int(time.time()),
        "owned_by": "vllm",
        "root": path,
        "parent": parent,
        "max_model_len": None,
        "permission": parent_card.get("permission", []) if parent_card else [],
    }


class ModelCatalog:
    """Models and adapters over one registry's replicas: each replica's cards and adapter slots, the adapters
    the router may load (configured, from the folder, or learned from a replica's card), and the routable
    replicas per model, cached for the hot path."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        adapters: Mapping[str, str] | None = None,
        assumed_max_loras: int = 0,
        adapter_slots: int = 0,
    ) -> None:
        """`adapters`: LoRA adapters by name, with their paths as the replicas see them (`--lora`; the
        folder's come through `add_adapters`); replicas' own adapters are learned from their /v1/models.
        `assumed_max_loras`: a replica's adapter slots until it reports its own. `adapter_slots`: adapters
        each replica keeps loaded (`--lora-slots`); 0: the default per its `max_loras`."""
        self._registry = registry
        self._adapter_paths: dict[str, str] = dict(adapters or {})
        """Every adapter's path: configured, or learned from a replica's card (its `root`)."""
        self._configured_adapters = set(self._adapter_paths)
        """Served whether or not a replica has them now; a learned one only while a replica lists it (an
        adapter someone unloads everywhere is gone, not loaded back by the router)."""
        self._adapter_parents: dict[str, str] = {}
        self._assumed_max_loras = assumed_max_loras
        self._adapter_slots = adapter_slots
        # Cached until routability or models change (`_reshaped`), so the hot path never scans the whole
        # fleet: routable replicas per model, their ids, the models served, the adapters served.
        self._views: dict[str, tuple[Replica, ...]] = {}
        self._view_ids: dict[str, tuple[str, ...]] = {}
        self._served: list[str] | None = None
        self._adapter_names: frozenset[str] | None = None
        for replica in registry:
            self._adopt(replica)
        registry.on_added(self._adopt)
        registry.on_reshape(self._reshaped)

    def _adopt(self, replica: Replica) -> None:
        replica.lora.max_loras = self._assumed_max_loras  # until its metrics say

    def _reshaped(self) -> None:
        """Which replicas are routable, or what they serve, may have changed."""
        self._views.clear()
        self._view_ids.clear()
        self._served = None
        self._adapter_names = None

    def set_model_cards(self, replica_id: str, cards: tuple[dict[str, Any], ...]) -> None:
        """A replica's /v1/models, as its probe read it."""
        replica = self._registry.find(replica_id)
        if replica is not None and cards != replica.model_cards:
            replica.set_model_cards(cards)
            for name, card in adapter_cards(cards).items():
                if isinstance(card.get("root"), str) and card["root"]:
                    self._adapter_paths.setdefault(name, card["root"])
                self._adapter_parents[name] = card["parent"]
            self._reshaped()

    def set_lora_info(self, replica_id: str, max_loras: int, active: frozenset[str]) -> None:
        """What `vllm:lora_requests_info` said: its adapter slots, and the adapters running or waiting."""
        replica = self._registry.find(replica_id)
        if replica is None:
            return
        lora = replica.lora
        was_enabled = lora.enabled
        if max_loras > 0:
            lora.max_loras = max_loras
        if lora.active != active:
            idle_now = bool(lora.active - active)
            lora.active = active
            if idle_now:
                self._registry.notify_room()  # an adapter went idle: a request waiting for a slot may load now
        if lora.enabled != was_enabled:
            self._reshaped()

    def add_adapters(self, found: Mapping[str, str]) -> list[str]:
        """Adapters to serve from now on, by name and path (the folder's, as its watch read it); those not
        configured before are added and their names returned."""
        new = {name: path for name, path in found.items() if name not in self._configured_adapters}
        if new:
            self._adapter_paths.update(new)
            self._configured_adapters.update(new)
            self._reshaped()
        return list(new)

    def routable(self, model: str) -> tuple[Replica, ...]:
        """Replicas routing may use for `model`, in the order they were added (cached until routability changes)."""
        view = self._views.get(model)
        if view is None:
            replicas = self._registry
            if self.is_adapter(model):
                # Any replica with LoRA on can load it (`policies/adapters.py` chooses where).
                parent = self._adapter_parents.get(model)
                view = tuple(
                    r
                    for r in replicas
                    if r.routable and r.lora.enabled and (model in r.models or parent is None or parent in r.models)
                )
            else:
                view = tuple(r for r in replicas if r.routable and model in r.models)
            self._views[model] = view
        return view

    def routable_ids(self, model: str) -> tuple[str, ...]:
        """The ids of `routable(model)`, sorted; the same tuple object until routability changes."""
        ids = self._view_ids.get(model)
        if ids is None:
            ids = self._view_ids[model] = tuple(sorted(r.id for r in self.routable(model)))
        return ids

    def candidates(self, model: str, exclude: Iterable[str] = ()) -> list[ReplicaView]:
        """Routable replicas serving `model`; those backing off (429/503) only when no other is left."""
        return self._registry.available(self.routable(model), exclude)

    def serves(self, model: str) -> bool:
        """Whether a routable replica serves `model` (cheap: read on every request)."""
        return bool(self.routable(model))

    def served_models(self) -> list[str]:
        """Models of routable replicas, de-duplicated, in replica order."""
        return list(self._served_models())

    def only_model(self) -> str | None:
        """The one base model routable replicas serve, when there is exactly one (adapters aside)."""
        served = [name for name in self._served_models() if not self.is_adapter(name)]
        return served[0] if len(served) == 1 else None

    def _served_models(self) -> list[str]:
        # Cached until routability or models change (`_reshaped`): read on every request.
        if self._served is None:
            self._served = list(self.model_cards(healthy_only=True))
        return self._served

    def refusing(self, model: str | None) -> list[tuple[str, str]]:
        """(id, cause) of the replicas that refuse the router itself (`Replica.misconfigured`) and may serve
        `model` (they list it, or their models could not be read; None: any model)."""
        return [
            (r.id, r.misconfigured)
            for r in self._registry.misconfigured()
            if r.misconfigured is not None and (model is None or not r.models or model in r.models)
        ]

    def known_models(self) -> list[str]:
        """Models any replica has ever reported, healthy now or not."""
        return list(self.model_cards(healthy_only=False))

    def known_base_models(self) -> list[str]:
        """`known_models` less the LoRA adapters: the models replicas are started for."""
        return [name for name in self.known_models() if not self.is_adapter(name)]

    def model_cards(self, healthy_only: bool) -> dict[str, dict[str, Any]]:
        """Every model, then every adapter the router can load (loaded somewhere or not), as vLLM's cards."""
        cards: dict[str, dict[str, Any]] = {}
        lora_on = False
        for replica in self._registry:
            if healthy_only and not replica.routable:
                continue
            lora_on = lora_on or replica.lora.enabled
            for card in replica.model_cards:
                cards.setdefault(str(card["id"]), card)
        if lora_on or not healthy_only:
            bases = [name for name, card in cards.items() if not card.get("parent")]
            for name in self._adapter_paths:  # in the order given or found, not a set's
                if name in self._configured_adapters and name not in cards:
                    parent = self._adapter_parents.get(name) or (bases[0] if len(bases) == 1 else None)
                    cards[name] = adapter_card(name, self._adapter_paths[name], parent, cards.get(parent or ""))
        return cards

    def is_adapter(self, model: str) -> bool:
        """Whether `model` names a LoRA adapter the router serves (cheap: read on every request)."""
        names = self._adapter_names
        if names is None:
            listed = {name for r in self._registry for name in adapter_cards(r.model_cards)}
            names = self._adapter_names = frozenset(self._configured_adapters | listed)
        return model in names

    def adapter_parent(self, adapter: str) -> str | None:
        """The base model an adapter runs on: as a replica listed it, else the one base model served."""
        parent = self._adapter_parents.get(adapter)
        if parent is not None:
            return parent
        return self.only_model()

    def adapter_path(self, adapter: str) -> str | None:
        """Where the replicas find the adapter (configured, or as a replica's card gave it)."""
        return self._adapter_paths.get(adapter)

    def adapter_slots_of(self, replica: Replica) -> AdapterSlots:
        return replica.lora.slots(self._adapter_slots)
