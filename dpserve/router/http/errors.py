"""OpenAI-style error bodies: every error the router produces goes through here."""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from starlette.responses import Response

CLIENT_CLOSED = 499
"""nginx's status for "client closed request": the client left before its answer; in metrics only."""


class OpenAIError(Exception):
    """An error to return to the client as `{"error": {...}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        )

    def to_response(self, extra_headers: dict[str, str] | None = None) -> Response:
        headers = {**self.headers, **(extra_headers or {})}
        return Response(self.body(), status_code=self.status, media_type="application/json", headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def no_replica(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="service_unavailable", code="no_healthy_replica")


def replica_misconfigured(refusals: Sequence[tuple[str, str]]) -> OpenAIError:
    """Replicas that refuse the router itself (its key, its TLS), as (replica id, cause): the gateway's fault,
    never the client's, so a 502 that names each replica and its cause, not the replica's 401."""
    named = "; ".join(f"replica {replica_id}: {cause}" for replica_id, cause in refusals)
    return OpenAIError(
        502,
        f"The router cannot use its replica(s), which refuse the router itself: {named}.",
        type="server_error",
        code="replica_misconfigured",
    )


def status_type(status: int) -> str:
    """The OpenAI error type that matches an HTTP status the framework raised on its own."""
    return {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")


def upstream_error_body(status: int, body: bytes, path: str) -> bytes:
    """A replica's error body, reshaped to OpenAI's `{"error": {...}}` when it is not already
    (FastAPI's own `{"detail": ...}` for an endpoint the replica does not serve, say)."""
    try:
        payload = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return body
    detail = payload.get("detail") if isinstance(payload, dict) else None
    if not isinstance(detail, str):
        detail = body[:200].decode("utf-8", "replace").strip() if payload is None and body else None
    message = f"The replica could not serve {path}" + (f": {detail}" if detail else f" (HTTP {status}).")
    return OpenAIError(status, message, type=status_type(status)).body()
