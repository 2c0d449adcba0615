"""Which replica holds which stored response (`/v1/responses` with `store`): the id's owner.

vLLM keeps a stored response in the memory of the replica that made it, so retrieving it, cancelling it
or continuing from it (`previous_response_id`) must reach that replica. The router learns each id as the
answer passes through and keeps the most recent ones in a bounded map; an id it has not seen (made
before a restart, or through another router) is looked for on the replicas.
"""

from __future__ import annotations

from collections import OrderedDict

import orjson

SSE_DATA = b"data:"


class ResponseOwners:
    """Response id -> replica id, the least recently used forgotten past `max_entries`."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._max = max_entries

    def get(self, response_id: str) -> str | None:
        owner = self._owners.get(response_id)
        if owner is not None:
            self._owners.move_to_end(response_id)
        return owner

    def remember(self, response_id: str, replica_id: str) -> None:
        self._owners[response_id] = replica_id
        self._owners.move_to_end(response_id)
        if len(self._owners) > self._max:
            self._owners.popitem(last=False)

    def __len__(self) -> int:
        return len(self._owners)


def id_of_answer(body: bytes) -> str | None:
    """The id of a non-streamed Responses answer."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    found = payload.get("id") if isinstance(payload, dict) else None
    return found if isinstance(found, str) and found else None


def id_of_stream(first: bytes) -> str | None:
    """The id in a Responses stream's first event (`response.created`, whose `response` has it)."""
    for line in first.split(b"\n"):
        if not line.startswith(SSE_DATA):
            continue
        try:
            event = orjson.loads(line[len(SSE_DATA) :])
        except orjson.JSONDecodeError:
            return None
        response = event.get("response") if isinstance(event, dict) else None
        found = response.get("id") if isinstance(response, dict) else None
        return found if isinstance(found, str) and found else None
    return None
