"""The app's answers for errors outside the hot path (which answers its own): always OpenAI-shaped JSON,
never a framework page; an unexpected error logged with its trace, the client told nothing of it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from dpserve.disconnect import ClientGone
from dpserve.router.http.errors import CLIENT_CLOSED, OpenAIError, bad_request, status_type

log = logging.getLogger("dpserve.router")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> Response:
        return exc.to_response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        if exc.status_code == 404:
            message = f"Unknown path: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        return OpenAIError(exc.status_code, message, type=status_type(exc.status_code)).to_response(
            dict(exc.headers or {})
        )

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # never read: the client has gone

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return validation_refusal(exc.errors()).to_response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        # Logged here with its trace; the client gets no internals.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return OpenAIError(500, "Internal router error.", type="server_error").to_response()


def validation_refusal(errors: Sequence[Any]) -> OpenAIError:
    """FastAPI's first validation error as a sentence naming the parameter (`limit`), not pydantic's dump."""
    first = errors[0] if errors else {}
    names = [part for part in first.get("loc", ()) if isinstance(part, str) and part not in ("query", "path", "body")]
    param = names[-1] if names else None
    reason = str(first.get("msg", "not valid")).rstrip(".")
    return bad_request(f"`{param}`: {reason}." if param else f"Invalid request: {reason}.", param=param)
