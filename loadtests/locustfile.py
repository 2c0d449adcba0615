"""Locust load test for any OpenAI-compatible server: the dpserve router, one replica, or a peer router.

    locust -f loadtests/locustfile.py --headless --host http://127.0.0.1:8000 -u 32 -r 32 -t 60s \
        --workload shared_prefix --prompt-tokens 128 --output-tokens 64 --csv out/run --html out/run.html

Entries in Locust's tables:
- `POST <path>` and `POST <path> [stream]`: one per request, failed on an HTTP error, an error event in the
  stream, or a stream that ends without `[DONE]`. Their time is the whole request (for streams too: the
  last byte, not the headers).
- Type `LLM`, each a distribution (the "response time" columns hold the value): `TTFT` (ms to the first
  token), `ITL` (ms between successive tokens, one sample per gap), `output_tokens` (per request; its
  "size" is the same count, so average size x requests/s = output tokens/s), `decode_tok_per_s` (tokens
  after the first over the time they took, per streamed request).
- With `--warmup S`, requests that end in the first S seconds are reported as `(warmup) POST ...` and
  send no LLM samples, so the other rows cover the steady state only.

Load: closed-loop users by default (`-u`, `-r`, `-t`, or `--shape steps --step-users N --step-time S`), or
open-loop Poisson arrivals with `--arrival-rate R` (requests/s in total, split evenly over the `-u` users,
each of which starts requests on its own clock without waiting for answers). Use `--processes P` (or
master and workers) when one load process would be the bottleneck.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from typing import Any

import gevent
from gevent.pool import Pool
from load_shapes import SHAPES, ShapePlan, arrival_gaps
from locust import FastHttpUser, LoadTestShape, constant, events, task
from locust.env import Environment
from openai_stream import StreamRecord, bearer_key, completion_text, completion_tokens
from workloads import APIS, WORKLOADS, LlmRequest, RequestFactory, WorkloadOptions

_user_numbers = itertools.count()


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    group = parser.add_argument_group("dpserve workload")
    group.add_argument("--workload", choices=WORKLOADS, default="random", help="what to send")
    group.add_argument("--api", choices=APIS, default="chat", help="chat, completions or mixed")
    group.add_argument("--stream-ratio", type=float, default=1.0, help="share of streamed requests (0..1)")
    group.add_argument("--prompt-tokens", type=int, default=128, help="prompt (or question) length, words")
    group.add_argument("--output-tokens", type=int, default=64, help="max_tokens of every request")
    group.add_argument("--prefix-tokens", type=int, default=512, help="shared prefix / conversation opening, words")
    group.add_argument("--groups", type=int, default=8, help="shared_prefix: number of shared prefixes")
    group.add_argument("--turns", type=int, default=4, help="multi_turn: turns per conversation")
    group.add_argument("--model", default="dpserve-tiny", help="model name sent in every request")
    group.add_argument("--no-ignore-eos", action="store_true", help="do not send vLLM's ignore_eos")
    group.add_argument("--seed", type=int, default=0, help="seed of every prompt")
    group.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", ""),
        help="sent as a Bearer token (the first, if a comma-separated list)",
    )
    group.add_argument("--shape", choices=SHAPES, default="steady", help="steady or a step ramp")
    group.add_argument("--step-users", type=int, default=0, help="steps: users added per step")
    group.add_argument("--step-time", type=float, default=0.0, help="steps: seconds per step")
    group.add_argument("--arrival-rate", type=float, default=0.0, help="open loop: Poisson arrivals per second")
    group.add_argument("--max-outstanding", type=int, default=1024, help="open loop: in-flight cap per user")
    group.add_argument("--warmup", type=float, default=0.0, help="seconds reported apart as (warmup)")


def workload_options(parsed: Any) -> WorkloadOptions:
    return WorkloadOptions(
        kind=parsed.workload,
        api=parsed.api,
        stream_ratio=parsed.stream_ratio,
        prompt_tokens=parsed.prompt_tokens,
        output_tokens=parsed.output_tokens,
        prefix_tokens=parsed.prefix_tokens,
        groups=parsed.groups,
        turns=parsed.turns,
        model=parsed.model,
        ignore_eos=not parsed.no_ignore_eos,
        seed=parsed.seed,
    )


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_: Any) -> None:
    # Every node (master and each worker) starts its own warm-up clock when the test starts.
    environment.warmup_ends = time.perf_counter() + (environment.parsed_options.warmup or 0.0)  # type: ignore[attr-defined]


class LoadShape(LoadTestShape):
    """`--shape steady` (-u, -r, -t as usual) or `--shape steps` (a step ramp up to -u users)."""

    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        parsed = self.runner.environment.parsed_options  # type: ignore[union-attr]
        plan = ShapePlan(
            shape=parsed.shape,
            users=parsed.num_users or 1,
            spawn_rate=parsed.spawn_rate or 1.0,
            run_time_s=parsed.run_time or None,
            step_users=parsed.step_users,
            step_time_s=parsed.step_time,
        )
        return plan.at(self.get_run_time())


class OpenAIUser(FastHttpUser):
    wait_time = constant(0)
    # Open-loop users keep many requests in flight on one connection pool.
    concurrency = 1024
    network_timeout = 600.0
    connection_timeout = 30.0

    def on_start(self) -> None:
        parsed = self.environment.parsed_options
        self.options = workload_options(parsed)
        runner = self.environment.runner
        number = getattr(runner, "worker_index", 0) * 100_000 + next(_user_numbers)
        self.factory = RequestFactory(self.options, number)
        key = bearer_key(parsed.api_key)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.pool = Pool(max(1, parsed.max_outstanding))
        self.arrival_rate = parsed.arrival_rate / max(1, parsed.num_users or 1) if parsed.arrival_rate else 0.0
        if self.arrival_rate and self.options.kind == "multi_turn":
            raise ValueError("multi_turn waits for each reply: use closed-loop users, not --arrival-rate")
        self.rng = random.Random(number)

    def on_stop(self) -> None:
        self.pool.kill()

    @task
    def generate(self) -> None:
        if not self.arrival_rate:
            self.send(self.factory.next())
            return
        next_at = time.perf_counter()
        for gap in arrival_gaps(self.arrival_rate, self.rng):
            next_at += gap
            delay = next_at - time.perf_counter()
            if delay > 0:
                gevent.sleep(delay)
            if self.pool.full():
                self._fire("LLM", "arrival dropped", 0.0, 0, RuntimeError("too many requests in flight"))
                continue
            self.pool.spawn(self.send, self.factory.next())

    def send(self, request: LlmRequest) -> None:
        name = f"{request.path} [stream]" if request.stream else request.path
        started = time.perf_counter()
        record = StreamRecord(started) if request.stream else None
        with self.client.post(
            request.path, json=request.body, headers=self.headers, name=name, stream=request.stream, catch_response=True
        ) as response:
            failure, tokens, text = None, None, ""
            if response.status_code != 200:
                failure = f"HTTP {response.status_code}: {_error_text(response)}"
            elif record is not None:
                failure = _read_stream(response, record)
                tokens, text = record.output_tokens, record.text
            else:
                try:
                    body = response.json()
                    tokens, text = completion_tokens(body), completion_text(body)
                except ValueError as exc:
                    failure = f"undecodable body: {exc}"
            finished = time.perf_counter()
            response.request_meta["response_time"] = (finished - started) * 1000
            warming = finished < getattr(self.environment, "warmup_ends", 0.0)
            if warming:
                response.request_meta["name"] = f"(warmup) {name}"
            if failure:
                response.failure(failure)
            else:
                response.success()
        if failure:
            return
        self.factory.record_reply(text)
        if not warming:
            self._report(record, tokens)

    def _report(self, record: StreamRecord | None, tokens: int | None) -> None:
        if tokens is not None:
            self._fire("LLM", "output_tokens", float(tokens), tokens)
        if record is None:
            return
        if record.ttft_s is not None:
            self._fire("LLM", "TTFT", record.ttft_s * 1000, 0)
        for gap in record.gaps_s:
            self._fire("LLM", "ITL", gap * 1000, 0)
        if record.decode_tokens_per_s is not None:
            self._fire("LLM", "decode_tok_per_s", record.decode_tokens_per_s, 0)

    def _fire(self, kind: str, name: str, value: float, length: int, exception: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=name,
            response_time=value,
            response_length=length,
            exception=exception,
            context={},
        )


def _read_stream(response: Any, record: StreamRecord) -> str | None:
    """Read the SSE body line by line as it arrives; the reason it failed, or None."""
    raw = response._response  # geventhttpclient's response: readline() returns each line as it comes
    try:
        while True:
            line = raw.readline(b"\n")
            if not line:
                break
            record.feed(line, time.perf_counter())
    except Exception as exc:  # a connection cut mid-stream is a failure of this request, not of the user
        return f"stream broken: {type(exc).__name__}: {exc}"
    return record.failure()


def _error_text(response: Any) -> str:
    error = getattr(response, "error", None)
    if error is not None:
        return f"{type(error).__name__}: {error}"
    try:
        body = response.json()
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        return str(message or body)[:300]
    except Exception:
        return (response.text or "")[:300]
