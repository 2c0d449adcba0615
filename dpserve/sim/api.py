"""The simulator's HTTP surface: what a vLLM OpenAI server answers, as the router sees it.

Response bodies carry the same keys as vLLM 0.32's (with `--enable-prompt-tokens-details`, which
`dpserve up` turns on for real replicas too), and errors the same `{"error": {...}}` shape and types.
One prompt and one choice per request: a batch of prompts or `n` > 1 is refused with a 400 that says so.
With data parallelism (dp.py) a generating request goes to the engine its `X-data-parallel-rank` header
names, else to the least loaded one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from jinja2 import TemplateError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from dpserve.disconnect import ClientGone, until_disconnect
from dpserve.sim.auth import RequireKey
from dpserve.sim.dp import RANK_HEADER, EngineGroup, RankOutOfRange, header_rank
from dpserve.sim.engine import GenerationRequest, RequestStats, RequestTooLarge
from dpserve.sim.formats import ChatFormat, CompletionFormat, ResponseFormat, new_id, usage
from dpserve.sim.metrics import SimMetrics
from dpserve.sim.tokenizer import SimTokenizer

JSON = "application/json"
SSE = "text/event-stream; charset=utf-8"


@dataclass(frozen=True)
class SimModel:
    name: str
    max_model_len: int
    root: str


class SimError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 404: "NotFoundError"}.get(self.status, "BadRequest")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), status_code=self.status, media_type=JSON)


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    max_tokens: int
    finish_reason: str
    stream: bool
    include_usage: bool
    priority: int = 0


class SimApi:
    def __init__(
        self,
        model: SimModel,
        tokenizer: SimTokenizer,
        engines: EngineGroup,
        metrics: SimMetrics,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: required on /v1 paths, as vLLM's --api-key (None: open)."""
        self.model = model
        self.api_key = api_key
        self.tokenizer = tokenizer
        self.engines = engines
        self.engine = engines.engines[0]
        """Engine 0: it also draws the length of an answer without max_tokens, before any engine is chosen."""
        self.metrics = metrics
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/tokenize", self._guard(self.tokenize), methods=["POST"]),
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guard(self.chat), methods=["POST"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            # vLLM's scale-out render endpoints (`vllm serve --enable-scale-out`), which vllm-router's
            # kv_aware reads token ids from: the ids and the model, not vLLM's whole GenerateRequest.
            Route("/v1/completions/render", self._guard(self.render_completion), methods=["POST"]),
            Route("/v1/chat/completions/render", self._guard(self.render_chat), methods=["POST"]),
        ]
        middleware = [Middleware(RequireKey, key=self.api_key)] if self.api_key else []
        return Starlette(routes=routes, middleware=middleware)

    @staticmethod
    def _guard(
        handler: Callable[[dict[str, Any], Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                body = orjson.loads(await request.body())
            except orjson.JSONDecodeError as exc:
                return SimError(400, f"Request body is not valid JSON: {exc}").response()
            if not isinstance(body, dict):
                return SimError(400, "Request body must be a JSON object.").response()
            try:
                # A client that leaves before a whole answer is ready aborts its request, as in vLLM.
                return await until_disconnect(request.receive, handler(body, request))
            except SimError as err:
                return err.response()
            except ClientGone:
                return Response(b"", status_code=499)

        return endpoint

    # Plain endpoints.
    async def health(self, request: Request) -> Response:
        return Response(b"", status_code=200)

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model.name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.model.root,
            "parent": None,
            "max_model_len": self.model.max_model_len,
            "permission": [
                {
                    "id": new_id("modelperm"),
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return Response(orjson.dumps({"object": "list", "data": [card]}), media_type=JSON)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's dev-mode endpoint: drops every cached block no running request uses, on every engine."""
        if not self.engines.reset_prefix_cache():
            return SimError(400, "Cannot reset the prefix cache while requests are running.").response()
        return Response(b"", status_code=200)

    # Parsing.
    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model.name:
            raise SimError(404, f"The model `{model}` does not exist. Valid aliases: {self.model.name}.", "model")

    def _chat_ids(self, body: dict[str, Any], add_generation_prompt: bool = True) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SimError(400, "`messages` must be a non-empty array.", "messages")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise SimError(400, f"`messages[{index}]` must be an object with a string `role`.", "messages")
            content = message.get("content")
            if not (content is None or isinstance(content, str) or _is_text_parts(content)):
                raise SimError(400, f"`messages[{index}].content` must be a string or text parts.", "messages")
        # A message without content (an assistant turn that only called tools) renders as empty text.
        messages = [
            message if message.get("content") is not None else {**message, "content": ""} for message in messages
        ]
        try:
            text = self.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
        except TemplateError as exc:
            raise SimError(400, f"The chat template cannot render these messages: {exc}", "messages") from None
        # The template writes BOS itself: no special tokens added on top, as vLLM does for chat.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _completion_ids(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
            if max(prompt) >= self.tokenizer.vocab_size:
                raise SimError(400, f"Token id {max(prompt)} is out of vocabulary.", "prompt")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise SimError(400, "The simulator serves one prompt per request.", "prompt")
        raise SimError(400, "`prompt` must be a string or an array of token ids.", "prompt")

    def _prompt(self, body: dict[str, Any], ids: list[int], max_tokens_field: str) -> Prompt:
        limit = self.model.max_model_len
        if len(ids) >= limit:
            raise SimError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{len(ids)} input tokens. Please reduce the length of the input prompt.",
                "input_tokens",
            )
        n = body.get("n", 1)
        if n not in (1, None):
            raise SimError(400, "The simulator generates one choice per request (`n` must be 1).", "n")
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise SimError(400, "`stream` must be a boolean.", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise SimError(400, "`stream_options` must be an object.", "stream_options")
        max_tokens = body.get(max_tokens_field, body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = self.engine.free_length(limit - len(ids))
            finish_reason = "stop"
        else:
            if not _is_token(max_tokens) or max_tokens < 1:
                raise SimError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
            finish_reason = "length"
        if len(ids) + max_tokens > limit:
            raise SimError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains {len(ids)} input tokens.",
                "max_tokens",
            )
        priority = body.get("priority", 0)
        if not _is_integer(priority):
            raise SimError(400, f"`priority` must be an integer, got {priority!r:.32}.", "priority")
        return Prompt(ids, max_tokens, finish_reason, stream, bool(options.get("include_usage")), priority)

    # Endpoints that generate.
    async def tokenize(self, body: dict[str, Any], _: Request) -> Response:
        self._check_model(body)
        if "messages" in body:
            ids = self._chat_ids(body, add_generation_prompt=body.get("add_generation_prompt", True) is not False)
        else:
            ids = self._completion_ids(body)
        payload = {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids, "token_strs": None}
        return Response(orjson.dumps(payload), media_type=JSON)

    async def render_completion(self, body: dict[str, Any], _: Request) -> Response:
        self._check_model(body)
        rendered = {"request_id": f"cmpl-{uuid.uuid4().hex}", "token_ids": self._completion_ids(body)}
        return Response(orjson.dumps([{**rendered, "model": self.model.name}]), media_type=JSON)

    async def render_chat(self, body: dict[str, Any], _: Request) -> Response:
        self._check_model(body)
        rendered = {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "token_ids": self._chat_ids(body)}
        return Response(orjson.dumps({**rendered, "model": self.model.name}), media_type=JSON)

    async def completions(self, body: dict[str, Any], http: Request) -> Response:
        self._check_model(body)
        prompt = self._prompt(body, self._completion_ids(body), "max_tokens")
        return await self._generate(
            prompt, CompletionFormat(self.model.name), header_rank(http.headers.get(RANK_HEADER))
        )

    async def chat(self, body: dict[str, Any], http: Request) -> Response:
        self._check_model(body)
        prompt = self._prompt(body, self._chat_ids(body), "max_completion_tokens")
        return await self._generate(prompt, ChatFormat(self.model.name), header_rank(http.headers.get(RANK_HEADER)))

    async def _generate(self, prompt: Prompt, fmt: ResponseFormat, rank: int | None) -> Response:
        request = GenerationRequest(prompt.ids, prompt.max_tokens, prompt.finish_reason, prompt.priority)
        try:
            self.engine.check_fits(request)  # every engine's cache is the same size
        except RequestTooLarge as exc:
            raise SimError(400, f"The request cannot fit this replica's KV cache: {exc}.", "max_tokens") from None
        try:
            chosen = self.engines.choose(rank)
        except RankOutOfRange as exc:
            # vLLM finds this once generation starts: a 400, or in a stream an error event (with a 200).
            if prompt.stream:
                return StreamingResponse(_error_stream(SimError(400, str(exc))), media_type=SSE)
            raise SimError(400, str(exc)) from None
        output = self.engines.engines[chosen].choose_output(self.tokenizer.output_ids(), prompt.max_tokens)
        stats = RequestStats(arrived=time.monotonic())
        tokens = self.engines.generate(chosen, request, output, stats, prompt.stream)
        if prompt.stream:
            return StreamingResponse(self._stream(tokens, output, stats, prompt, fmt), media_type=SSE)
        pieces = [self.tokenizer.piece(token) async for token in tokens]
        body = fmt.full("".join(pieces), prompt.finish_reason, usage(len(prompt.ids), len(pieces), stats.cached_tokens))
        return Response(orjson.dumps(body), media_type=JSON)

    async def _stream(
        self, tokens: AsyncIterator[int], output: list[int], stats: RequestStats, prompt: Prompt, fmt: ResponseFormat
    ) -> AsyncIterator[bytes]:
        opening = fmt.opening()
        last = len(output) - 1
        index = 0
        async for token in tokens:
            if index == 0 and opening is not None:
                # vLLM sends chat's role chunk with the first token, after prefill: so TTFT measured
                # on the first event means the same on a sim as on vLLM.
                yield _event(opening)
            finishing = index == last
            finish_reason = prompt.finish_reason if finishing else None
            yield _event(fmt.chunk(self.tokenizer.piece(token), finish_reason, finishing and not prompt.include_usage))
            index += 1
        if prompt.include_usage:
            yield _event(fmt.usage_chunk(usage(len(prompt.ids), stats.output_tokens, stats.cached_tokens)))
        yield b"data: [DONE]\n\n"


async def _error_stream(error: SimError) -> AsyncIterator[bytes]:
    yield _event(error.body())
    yield b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: Any) -> bool:
    return _is_integer(value) and value >= 0


def _is_text_parts(content: Any) -> bool:
    return isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    )
