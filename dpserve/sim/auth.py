"""`dpserve sim --api-key`: the key check of vLLM's `--api-key` (its AuthenticationMiddleware), on the same
paths: `Authorization: Bearer KEY` on every path under /v1, /v2, /inference and /cohere (OPTIONS aside); the
rest (/health, /metrics, /tokenize, ...) open. A wrong or missing key: 401 `{"error": "Unauthorized"}`."""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
"""vLLM 0.32's GUARDED_PREFIX (vllm/entrypoints/serve/middleware/authenticate.py)."""


class RequireKey:
    """Pure ASGI, as vLLM's: the key is compared by its SHA-256, in constant time."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def allowed(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path.startswith(GUARDED_PREFIXES) and not self.allowed(Headers(scope=scope)):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
