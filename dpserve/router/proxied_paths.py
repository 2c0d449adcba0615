"""ASGI middleware: the proxied endpoints' paths go straight to the hot path, every other path on to
FastAPI's exception handling and routing (admin, status, metrics). It sits innermost among the app's
middleware, so access control and anything added later wrap both alike."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from dpserve.router.endpoints import RESPONSE_BY_ID
from dpserve.router.errors import OpenAIError


class HotPath:
    """Where the proxied paths are answered: the app the lifespan builds (it needs a running loop); until
    then, and after it ends, a 503."""

    def __init__(self, paths: Iterable[str]) -> None:
        self._paths = frozenset(paths)
        self.app: ASGIApp = _not_serving

    def serve(self, app: ASGIApp) -> None:
        self.app = app

    def stop(self) -> None:
        self.app = _not_serving

    def serves(self, path: str) -> bool:
        return path in self._paths or path.startswith(RESPONSE_BY_ID)


class ProxiedPaths:
    def __init__(self, app: ASGIApp, hot_path: HotPath) -> None:
        self.app = app
        self.hot_path = hot_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self.hot_path
        if scope["type"] == "http" and hot.serves(scope["path"]):
            await hot.app(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _not_serving(scope: Scope, receive: Receive, send: Send) -> None:
    error = OpenAIError(
        503, "The router is not serving (it is starting or stopping).", type="service_unavailable", code="not_serving"
    )
    await error.to_response()(scope, receive, send)
