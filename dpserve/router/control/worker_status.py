"""`/status` for the whole router. With `--workers N` the kernel hands each request for `/status` (and the
status page) to any one worker; that worker answers for all of them, as `/metrics` does: its own status
and each sibling's (`/status?scope=worker` on the sibling's private port), combined.

What each worker counts itself (requests in flight and served per replica, its queue, its receipts and
shadow tallies) is added up; what every worker sees alike (a replica's health, its engine's load, the GPUs,
discovery, peers) is this worker's reading. Rates are computed again from the summed counts, never averaged.
`workers` lists each worker (its process id, its private URL: none for the one answering) and whether it
answered."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from dpserve.router.observe.worker_metrics import WORKER_SCOPE, read_siblings

REPLICA_COUNTS = ("in_flight", "served_total")
FLOW_COUNTS = ("queued", "queue_timeouts")
RECEIPT_COUNTS = ("receipts", "scored", "prompt_tokens", "predicted_cached_tokens", "realized_cached_tokens")
SHADOW_COUNTS = ("decisions", "agreed", "prompt_tokens", "estimated_cached_tokens")


class WorkerStatus:
    """Reads the siblings' statuses and combines them with this worker's."""

    def __init__(self, siblings: Sequence[str], headers: Callable[[], Mapping[str, str]] = dict) -> None:
        self._siblings = tuple(siblings)
        self._headers = headers

    async def whole(self, own: dict[str, Any], scope: str) -> dict[str, Any]:
        if scope == WORKER_SCOPE or not self._siblings:
            return own
        theirs = [_status(text) for text in await read_siblings(self._siblings, "/status", self._headers())]
        merged = combine(own, [status for status in theirs if status is not None])
        merged["workers"] = [
            {"pid": own.get("pid"), "url": None, "answered": True},
            *(
                {"pid": None if status is None else status.get("pid"), "url": url, "answered": status is not None}
                for url, status in zip(self._siblings, theirs, strict=True)
            ),
        ]
        return merged


def _status(text: str | None) -> dict[str, Any] | None:
    try:
        body = orjson.loads(text) if text is not None else None
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


def combine(own: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """This worker's status with its siblings' counts added (see the module's docstring)."""
    merged = dict(own)
    merged["replicas"] = [_replica(entry, others) for entry in own.get("replicas", [])]
    if "flow" in own:
        merged["flow"] = _flow(own["flow"], [other["flow"] for other in others if "flow" in other])
    if "routing_quality" in own:
        merged["routing_quality"] = _receipts(
            own["routing_quality"], [other["routing_quality"] for other in others if "routing_quality" in other]
        )
    if "control_plane_cpu_s" in own:  # each worker's own CPU: the router's is their sum
        merged["control_plane_cpu_s"] = _add_maps(
            [own["control_plane_cpu_s"], *(other.get("control_plane_cpu_s", {}) for other in others)]
        )
    if "shadows" in own:
        merged["shadows"] = _shadows(own["shadows"], [other["shadows"] for other in others if "shadows" in other])
    return merged


def _replica(entry: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    same = [theirs for other in others for theirs in other.get("replicas", []) if theirs.get("id") == entry["id"]]
    return {**entry, **_sums([entry, *same], REPLICA_COUNTS)}


def _flow(own: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    merged = {**own, **_sums([own, *others], FLOW_COUNTS)}
    merged["queued_by_priority"] = _add_maps(
        [own.get("queued_by_priority", {}), *(o.get("queued_by_priority", {}) for o in others)]
    )
    merged["oldest_queued_s"] = max([own.get("oldest_queued_s", 0.0), *(o.get("oldest_queued_s", 0.0) for o in others)])
    return merged


def _receipts(own: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    everyone = [own, *others]
    merged = {**own, **_sums(everyone, RECEIPT_COUNTS)}
    merged["classes"] = _add_maps([summary.get("classes", {}) for summary in everyone])
    prompt = merged["prompt_tokens"]
    merged["predicted_hit_rate"] = merged["predicted_cached_tokens"] / prompt if prompt else None
    merged["realized_hit_rate"] = merged["realized_cached_tokens"] / prompt if prompt else None
    hits = merged["classes"].get("hit", 0)
    error = sum(
        (summary.get("hit_mean_error_blocks") or 0.0) * summary.get("classes", {}).get("hit", 0) for summary in everyone
    )
    merged["hit_mean_error_blocks"] = error / hits if hits else None
    return merged


def _shadows(own: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    merged = dict(own)
    merged["live_modelled"] = _tally(own["live_modelled"], [other["live_modelled"] for other in others])
    merged["shadows"] = {
        name: _tally(tally, [other["shadows"][name] for other in others if name in other.get("shadows", {})])
        for name, tally in own.get("shadows", {}).items()
    }
    return merged


def _tally(own: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    everyone = [own, *others]
    merged = {**own, **_sums(everyone, SHADOW_COUNTS)}
    decisions, prompt = merged["decisions"], merged["prompt_tokens"]
    merged["estimated_hit_rate"] = merged["estimated_cached_tokens"] / prompt if prompt else None
    load = sum((tally.get("mean_load") or 0.0) * tally.get("decisions", 0) for tally in everyone)
    merged["mean_load"] = load / decisions if decisions else None
    by_replica = _add_maps([tally.get("by_replica", {}) for tally in everyone])
    merged["by_replica"] = dict(sorted(by_replica.items()))
    replicas = own.get("replicas")  # the fair share's divisor, the same for every worker
    merged["max_share"] = max(by_replica.values()) * replicas / decisions if replicas and decisions else None
    return merged


def _sums(parts: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> dict[str, Any]:
    return {key: sum(part.get(key, 0) for part in parts) for key in keys}


def _add_maps(maps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for counts in maps:
        for key, value in counts.items():
            total[key] = total.get(key, 0) + value
    return total
