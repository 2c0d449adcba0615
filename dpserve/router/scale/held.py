"""What one router holds for a model, as the scale signal counts it and peers send it to each other."""

from __future__ import annotations

from typing import NamedTuple


class Held(NamedTuple):
    """Requests one router holds for a model: for room in its queue, and for a replica to start (cold: on their
    way once a replica serves the model), each with when its oldest began waiting (0 with none)."""

    queued: int = 0
    queued_since: float = 0.0
    cold: int = 0
    cold_since: float = 0.0

    def moved(self, offset: float) -> Held:
        """The same on a clock `offset` seconds ahead (the wire carries the sender's wall clock)."""
        queued_since = round(self.queued_since + offset, 3) if self.queued else 0.0
        cold_since = round(self.cold_since + offset, 3) if self.cold else 0.0
        return Held(self.queued, queued_since, self.cold, cold_since)
