"""A request for a model no replica serves right now, in a fleet that starts replicas on demand
(`--cold-start-wait`): it waits, counted by the scale advisor (so the signal asks for a replica), until one
serves it, or is refused at once with 503 and Retry-After when the measured start-up would outlast the
wait (and at the wait's end, if none came)."""

from __future__ import annotations

import asyncio
import math
import time

from dpserve.replicas.catalog import ModelCatalog
from dpserve.router.http.errors import OpenAIError
from dpserve.router.scale.advisor import ScaleAdvisor

RECHECK_S = 0.05
"""While requests wait for a replica, how often they look (a replica's first probe makes it serve)."""
WAITED_FOR = frozenset({"no_healthy_replica", "model_not_found"})


def cold_start_refused(message: str, retry_after_s: float) -> OpenAIError:
    return OpenAIError(
        503,
        message,
        type="service_unavailable",
        code="replica_starting",
        headers={"retry-after": str(max(1, math.ceil(retry_after_s)))},
    )


class ColdStart:
    def __init__(self, catalog: ModelCatalog, advisor: ScaleAdvisor, wait_s: float) -> None:
        self._catalog, self._advisor, self.wait_s = catalog, advisor, wait_s

    def covers(self, error: OpenAIError) -> bool:
        """Whether a request refused with `error` waits for a replica instead: none serves its model, or
        (an unknown model) none serves any model yet, so its name cannot be checked."""
        if error.code == "no_healthy_replica":
            return True
        return error.code == "model_not_found" and not self._catalog.served_models()

    def _served(self, model: str | None) -> bool:
        """A replica serves it; or, a name no replica ever reported, some replica serves now to check it by."""
        catalog = self._catalog
        if model is None or model not in catalog.known_models():
            return bool(catalog.served_models())
        return catalog.serves(model)

    def _model_of_any(self) -> str:
        """Whose demand a request naming no model is: the one model replicas reported, else none known."""
        catalog = self._catalog
        known = catalog.known_base_models()
        return known[0] if known else ""

    async def wait(self, model: str | None) -> None:
        """Returns once a replica serves `model` (None: any model); else 503 with Retry-After."""
        advisor, wait_s = self._advisor, self.wait_s
        name = model if model is not None else self._model_of_any()
        eta = advisor.eta_s()
        if eta is not None and eta > wait_s:
            advisor.cold.refused(name, time.monotonic() + eta)  # its retry finds the replica it asks for
            advisor.held_changed()
            raise cold_start_refused(
                f"No replica serves this model now; one is expected to start in {eta:.0f} s, longer than this "
                f"router waits ({wait_s:g} s). Retry later.",
                eta,
            )
        arrived = time.monotonic()  # the advisor's clock: the oldest wait is one of its inputs
        advisor.cold.add(name, arrived)
        advisor.held_changed()
        try:
            while not self._served(model):
                if time.monotonic() - arrived >= wait_s:
                    eta = advisor.eta_s()
                    raise cold_start_refused(
                        f"No replica started to serve this model within {wait_s:g} s. Retry later.",
                        eta if eta else wait_s,
                    )
                await asyncio.sleep(RECHECK_S)
        finally:
            advisor.cold.remove(name, arrived)
            advisor.held_changed()
