"""The monitor's reads of replicas (/health, /metrics, /v1/models) over the hot path's lean client.

aiohttp spent about 1.2 ms of the router's CPU on a /health read over a new connection and 2.9 ms on a
visit's three reads, against 0.3 and 1.0 ms here (docs/benchmarks/scale.md): at 1024 replicas the visits of
idle ones were most of the idle control plane. The pool is the monitor's own, so its connections and
deadlines are apart from the requests'.
"""

from __future__ import annotations

import asyncio
import functools

from dpserve.replicas.access import ReplicaAccess
from dpserve.replicas.monitor import Misconfigured, ProbeFailed
from dpserve.router.http.upstream_client import (
    Address,
    Deadlines,
    ReplicaMisconfigured,
    ResponseTooLarge,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
)

MAX_READ_BYTES = 16 * 2**20
"""A replica's /metrics with many LoRA adapters or engines is large; anything past this is not vLLM's."""


class PooledReads:
    """`ReplicaReads` over an `UpstreamPool`: each read whole within `timeout_s`, connect included."""

    def __init__(self, access: ReplicaAccess, timeout_s: float) -> None:
        deadlines = Deadlines(connect_s=timeout_s, write_s=timeout_s, read_s=timeout_s, total_s=timeout_s)
        self._pool = UpstreamPool(deadlines, max_response_bytes=MAX_READ_BYTES, access=access)
        self._timeout_s = timeout_s

    def use_access(self, access: ReplicaAccess) -> None:
        self._pool.use_access(access)

    async def get(self, base_url: str, path: str) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(self._timeout_s):
                key_changes = self._pool.key_changes
                response = await self._pool.request(_address(base_url), "GET", path, b"", {})
                try:
                    status, body = response.status, await response.read()
                finally:
                    response.release()  # closes it unless read whole
                if status == 401 and key_changes != self._pool.key_changes:  # no verdict on a key replaced since
                    raise ProbeFailed(f"{path}: sent with the replicas' previous key, replaced meanwhile")
                return status, body
        except ReplicaMisconfigured as refused:
            raise Misconfigured(refused.cause) from None
        except UpstreamConnectError as exc:
            raise ProbeFailed(str(exc), refused=True) from None  # as the request path counts it
        except TimeoutError:
            raise ProbeFailed(f"{path} took over {self._timeout_s:g} s") from None
        except (UpstreamError, ResponseTooLarge) as exc:
            raise ProbeFailed(f"{path}: {exc}") from None

    def close(self) -> None:
        self._pool.close()


@functools.lru_cache(maxsize=16384)
def _address(url: str) -> Address:
    return Address.from_url(url)
