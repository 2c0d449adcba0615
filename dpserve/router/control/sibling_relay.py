"""With `--workers N`, the kernel hands an admin request to any one worker; a change to the fleet made there
(a replica added, drained, resumed or removed) is made on every sibling too, on its private port with
`?scope=worker`, so all N route to the same replicas. Before, `dpserve up --workers 2 --max-replicas B` told
one worker of each replica it started, and the other never routed to it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

import aiohttp

from dpserve.router.flow.access import KeyRing
from dpserve.router.observe.worker_metrics import SIBLING_TIMEOUT_S, WORKER_SCOPE

log = logging.getLogger("dpserve.router")


def sibling_headers(ring: KeyRing) -> dict[str, str]:
    """What a worker reads or tells its siblings with: an admin key in force (else a metrics key), if any."""
    keys = ring.keys
    key = (keys.admins or keys.metrics or (None,))[0]
    return {"authorization": f"Bearer {key.decode()}"} if key is not None else {}


class SiblingRelay:
    def __init__(self, siblings: Sequence[str], headers: Callable[[], Mapping[str, str]] = dict) -> None:
        """`headers`: the key the siblings take (the one in force: key files change)."""
        self._siblings = tuple(siblings)
        self._headers = headers

    def relays(self, scope: str | None) -> bool:
        """Whether a change asked with this `scope` goes to the siblings (not one a sibling relayed)."""
        return bool(self._siblings) and scope != WORKER_SCOPE

    async def relay(self, method: str, path: str, body: bytes = b"") -> list[str]:
        """Makes the change on every sibling; the siblings that did not take it (logged: one restarting is
        told again by whoever manages the fleet, as a restarted router is)."""
        timeout = aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S)
        headers = {**self._headers(), "content-type": "application/json"}
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            answers = await asyncio.gather(*(self._one(session, url, method, path, body) for url in self._siblings))
        return [url for url, took in zip(self._siblings, answers, strict=True) if not took]

    async def _one(self, session: aiohttp.ClientSession, url: str, method: str, path: str, body: bytes) -> bool:
        try:
            async with session.request(method, f"{url}{path}", params={"scope": WORKER_SCOPE}, data=body) as resp:
                if resp.status < 300:
                    return True
                log.warning("worker %s refused %s %s: %d %s", url, method, path, resp.status, await resp.text())
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("worker %s not told of %s %s: %s", url, method, path, type(exc).__name__)
        return False
