"""Every client endpoint of a vLLM OpenAI server (0.32's route table) that the router relays, and how.

An endpoint says what its body is (JSON, a multipart form, nothing), which field it cannot do without,
whether it may stream, and which prompt the routing policies read from it (`prompt`): generation
endpoints give prefix and session features to the cache-aware policies; the rest route on load alone.
Endpoints that act on one replica's state (adapters, sleep, caches, profiling) are not here: they are
the admin API's (`dpserve/router/control/engine_ops.py`). The router answers /health, /ready, /metrics and
/v1/models itself; SageMaker's /ping is the replica's own health check and not relayed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class BodyKind(Enum):
    JSON = "json"
    FORM = "multipart"
    NONE = "none"


class Prompt(Enum):
    """Where a request's prompt is, for the policies that read it."""

    CHAT = "chat"  # `messages`
    COMPLETION = "completions"  # `prompt`
    RESPONSE = "responses"  # `input` (+ `instructions`), read as chat messages


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    """The metrics label."""
    path: str
    required_field: str | None = None
    can_stream: bool = False
    method: str = "POST"
    body: BodyKind = BodyKind.JSON
    prompt: Prompt | None = None
    """None: routed on load alone."""


CHAT = Endpoint("chat", "/v1/chat/completions", "messages", can_stream=True, prompt=Prompt.CHAT)
COMPLETIONS = Endpoint("completions", "/v1/completions", "prompt", can_stream=True, prompt=Prompt.COMPLETION)
RESPONSES = Endpoint("responses", "/v1/responses", "input", can_stream=True, prompt=Prompt.RESPONSE)
MESSAGES = Endpoint("messages", "/v1/messages", "messages", can_stream=True, prompt=Prompt.CHAT)
EMBEDDINGS = Endpoint("embeddings", "/v1/embeddings", "input")
VERSION = Endpoint("version", "/version", method="GET", body=BodyKind.NONE)
RESPONSE_BY_ID = "/v1/responses/"
"""GET /v1/responses/{id} and POST /v1/responses/{id}/cancel: answered by the replica that stored it."""

PROXIED_ENDPOINTS: tuple[Endpoint, ...] = (
    CHAT,
    COMPLETIONS,
    RESPONSES,
    MESSAGES,
    Endpoint("messages_count_tokens", "/v1/messages/count_tokens", "messages"),
    Endpoint("chat_batch", "/v1/chat/completions/batch", "messages"),
    Endpoint("systemone", "/v1/systemone"),
    Endpoint("generative_scoring", "/generative_scoring"),
    Endpoint("invocations", "/invocations"),  # SageMaker's one endpoint for every task
    EMBEDDINGS,
    Endpoint("embed_v2", "/v2/embed"),
    Endpoint("pooling", "/pooling"),
    Endpoint("classify", "/classify"),
    Endpoint("score", "/score"),
    Endpoint("score", "/v1/score"),
    Endpoint("rerank", "/rerank"),
    Endpoint("rerank", "/v1/rerank"),
    Endpoint("rerank", "/v2/rerank"),
    Endpoint("tokenize", "/tokenize"),
    Endpoint("detokenize", "/detokenize", "tokens"),
    Endpoint("render", "/v1/chat/completions/render", "messages"),
    Endpoint("render", "/v1/completions/render", "prompt"),
    Endpoint("render", "/v1/messages/render", "messages"),
    Endpoint("render", "/v1/responses/render", "input"),
    Endpoint("transcriptions", "/v1/audio/transcriptions", "file", can_stream=True, body=BodyKind.FORM),
    Endpoint("translations", "/v1/audio/translations", "file", can_stream=True, body=BodyKind.FORM),
    VERSION,
)

PROXIED_PATHS = frozenset(endpoint.path for endpoint in PROXIED_ENDPOINTS)


_RESPONSE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,256}")  # vLLM's are resp_ and hex


def by_id_endpoint(path: str, method: str) -> Endpoint | None:
    """GET /v1/responses/{id} or POST /v1/responses/{id}/cancel, as an endpoint of its own."""
    if not path.startswith(RESPONSE_BY_ID):
        return None
    response_id, _, action = path[len(RESPONSE_BY_ID) :].partition("/")
    if not _RESPONSE_ID.fullmatch(response_id) or action not in ("", "cancel"):
        return None
    if action == "cancel":
        return Endpoint("responses_cancel", path, method="POST", body=BodyKind.NONE)
    return Endpoint("responses_get", path, method="GET", body=BodyKind.NONE)


def route(endpoint: Endpoint) -> str:
    """The endpoint's path as a template, a stored response's id as `{response_id}`: what names a span, so
    the names stay few however many responses there are."""
    response_id = path_response_id(endpoint)
    return endpoint.path if response_id is None else endpoint.path.replace(response_id, "{response_id}", 1)


def path_response_id(endpoint: Endpoint) -> str | None:
    if not endpoint.path.startswith(RESPONSE_BY_ID):
        return None
    return endpoint.path[len(RESPONSE_BY_ID) :].partition("/")[0]
