"""How many batch lines may start now: a pure function of the replicas' state, so batch work fills only
the room other requests leave and gives it back as they come."""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpserve.policies.base import ReplicaView


def batch_room(
    replicas: Sequence[ReplicaView],
    running: int,
    slots: int,
    reserve: float,
    queued: int,
    urgent: bool = False,
) -> int:
    """Lines that may start besides the `running` ones (this router's, started and not ended). Each healthy
    replica offers `slots`, fewer where its learned capacity less the `reserve` share is smaller; while
    other requests come (`urgent`), the `reserve` share of the fleet's slots is left to them too (never the
    last one), so one arriving finds a replica without batch work where there are several; every other
    request on the fleet (this router's, its peers', other clients') takes one back; nothing while
    requests wait in the router's queue (`queued`)."""
    if queued:
        return 0
    offered = 0
    load = 0
    for replica in replicas:
        confirmed = replica.confirmed_capacity
        if confirmed:
            offered += min(slots, confirmed - min(confirmed - 1, math.ceil(confirmed * reserve)))
        else:
            offered += slots
        load += replica.load
    if urgent and offered > 1:
        offered -= min(offered - 1, math.ceil(offered * reserve))
    # Running lines already sent count in the replicas' load; those not yet sent do not, so the others'
    # load is never taken below 0.
    others = max(0, load - running)
    return max(0, offered - others - running)
