"""`/status` for the whole router over `--workers`: each worker's own counts added, shared readings once,
rates computed again from the sums (no sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from dpserve.router.control.sibling_relay import SiblingRelay, sibling_headers
from dpserve.router.control.worker_status import combine
from dpserve.router.flow.access import KeyRing, Keys
from dpserve.router.observe.worker_metrics import WORKER_SCOPE
from dpserve.router.quality.receipts import ReceiptBook
from dpserve.router.quality.shadows import ShadowTally


def _worker(in_flight: int, served: int, healthy: bool, queued: int, oldest: float) -> dict[str, Any]:
    replica = {"id": "r0", "healthy": healthy, "in_flight": in_flight, "served_total": served, "waiting": 3}
    flow = {"flow_control": True, "queued": queued, "queued_by_priority": {"high": queued}, "oldest_queued_s": oldest}
    return {"policy": "kv_aware", "replicas": [replica], "flow": {**flow, "queue_timeouts": 1}}


def test_each_workers_own_counts_add_up_and_shared_readings_are_this_workers() -> None:
    merged = combine(_worker(2, 40, True, 1, 0.5), [_worker(3, 60, False, 2, 1.5)])
    (replica,) = merged["replicas"]
    assert (replica["in_flight"], replica["served_total"]) == (5, 100)
    # The engine's own load is the same replica seen twice: not doubled; health is this worker's reading.
    assert (replica["waiting"], replica["healthy"]) == (3, True)
    flow = merged["flow"]
    assert (flow["queued"], flow["queue_timeouts"], flow["queued_by_priority"]) == (3, 2, {"high": 3})
    assert flow["oldest_queued_s"] == 1.5


def test_a_replica_only_this_worker_knows_keeps_its_own_counts() -> None:
    other = _worker(3, 60, True, 0, 0.0)
    other["replicas"][0]["id"] = "r9"
    (replica,) = combine(_worker(2, 40, True, 0, 0.0), [other])["replicas"]
    assert (replica["id"], replica["served_total"]) == ("r0", 40)


def test_receipt_rates_are_computed_from_the_summed_tokens_not_averaged() -> None:
    small = {"receipts": 1, "scored": 1, "classes": {"hit": 1}, "hit_mean_error_blocks": 1.0}
    small |= {"prompt_tokens": 100, "predicted_cached_tokens": 100, "realized_cached_tokens": 100}
    large = {"receipts": 1, "scored": 1, "classes": {"cold": 1}, "hit_mean_error_blocks": None}
    large |= {"prompt_tokens": 900, "predicted_cached_tokens": 0, "realized_cached_tokens": 0}
    merged = combine({"replicas": [], "routing_quality": small}, [{"replicas": [], "routing_quality": large}])
    quality = merged["routing_quality"]
    assert quality["realized_hit_rate"] == pytest.approx(0.1)  # an average of the two rates would say 0.5
    assert quality["classes"] == {"hit": 1, "cold": 1} and quality["receipts"] == 2
    assert quality["hit_mean_error_blocks"] == pytest.approx(1.0)


def test_a_receipt_summary_carries_the_tokens_its_rates_come_from() -> None:
    summary = ReceiptBook(sample=1.0).summary()
    for key in ("prompt_tokens", "predicted_cached_tokens", "realized_cached_tokens", "classes", "receipts"):
        assert key in summary


def test_shadow_tallies_add_up_and_their_shares_are_over_the_sums() -> None:
    one = ShadowTally(decisions=4, agreed=2, prompt_tokens=100, cached_tokens=50.0, load=8, by_replica={"r0": 4})
    two = ShadowTally(decisions=4, agreed=4, prompt_tokens=300, cached_tokens=0.0, load=0, by_replica={"r1": 4})

    def status(tally: ShadowTally) -> dict[str, Any]:
        shadows = {"prefill_ms_per_token": 0.1, "live_modelled": tally.to_dict(2), "shadows": {"rr": tally.to_dict(2)}}
        return {"replicas": [], "shadows": shadows}

    merged = combine(status(one), [status(two)])["shadows"]["shadows"]["rr"]
    assert (merged["decisions"], merged["agreed"], merged["prompt_tokens"]) == (8, 6, 400)
    assert merged["estimated_hit_rate"] == pytest.approx(50 / 400)
    assert merged["mean_load"] == pytest.approx(1.0)
    assert merged["by_replica"] == {"r0": 4, "r1": 4}
    # Each worker alone sent everything to one replica (share 2.0); together they spread evenly.
    assert one.to_dict(2)["max_share"] == 2.0 and merged["max_share"] == pytest.approx(1.0)


def test_a_fleet_change_goes_to_the_siblings_once_with_the_key_in_force() -> None:
    """The worker a change reached tells its siblings (`?scope=worker`); a sibling told does not tell again."""
    relay = SiblingRelay(("http://127.0.0.1:9",))
    assert relay.relays(None) and not relay.relays(WORKER_SCOPE)
    assert not SiblingRelay(()).relays(None)  # one worker: nobody to tell
    ring = KeyRing(Keys(admins=(b"admin-1",), metrics=(b"metrics-1",)))
    assert sibling_headers(ring) == {"authorization": "Bearer admin-1"}
    ring.keys = Keys(metrics=(b"metrics-2",))  # a key file changed
    assert sibling_headers(ring) == {"authorization": "Bearer metrics-2"}
    assert sibling_headers(KeyRing(Keys())) == {}
