"""Client traffic for the integration tests that change a fleet under load: a chat, a long prompt, a steady
load of non-streaming requests whose every outcome is kept, a wait that says what it waited for, and
closed loops of streams per tenant and priority (flow control)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import orjson

from dpserve.replicas.prometheus_text import parse_samples

MODEL = "dpserve-tiny"
ANSWER_TOKENS = 16
"""What `stream_once` asks for: on a sim at 10 ms a token, an answer of about 0.17 s."""


def long_prompt(first_word: str) -> str:
    """Hundreds of tokens for the tiny model, several of vLLM's 128-token CPU blocks (KV events come per
    full block), starting with `first_word` so prompts with different first words share no prefix."""
    return " ".join([first_word, *(f"{first_word[::-1]}{index}" for index in range(60))])


def chat(url: str, text: str, max_tokens: int = 8, timeout_s: float = 30) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout_s)


@dataclass
class Load:
    """Non-streaming chat requests from a few threads until stopped; every outcome kept."""

    url: str
    workers: int = 4
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self, worker: int) -> None:
        sent = 0
        while not self._stop.is_set():
            sent += 1
            try:
                response = chat(self.url, f"worker {worker} request {sent}: tell me about containers")
                outcome = None if response.status_code == 200 else f"{response.status_code}: {response.text[:200]}"
            except httpx.HTTPError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            with self._lock:
                if outcome is None:
                    self.ok += 1
                else:
                    self.failures.append(outcome)

    @contextlib.contextmanager
    def running(self) -> Iterator[Load]:
        threads = [threading.Thread(target=self._run, args=(index,), daemon=True) for index in range(self.workers)]
        for thread in threads:
            thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            for thread in threads:
                thread.join(timeout=60)

    def count(self) -> int:
        with self._lock:
            return self.ok


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.25) -> float:
    """Seconds until `predicate()` held; fails the test past `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return time.monotonic() - start
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@dataclass
class Answer:
    tenant: str
    priority: str
    started: float
    ttft: float | None
    ended: float
    status: int
    code: str | None = None


async def stream_once(
    session: aiohttp.ClientSession, url: str, tenant: str, priority: str = "standard", max_tokens: int = ANSWER_TOKENS
) -> Answer:
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"hello from {tenant}"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    )
    headers = {"content-type": "application/json", "x-dpserve-tenant": tenant, "x-dpserve-priority": priority}
    started = time.monotonic()
    ttft = None
    async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as response:
        if response.status != 200:
            error = orjson.loads(await response.read())["error"]
            return Answer(tenant, priority, started, None, time.monotonic(), response.status, error["code"])
        async for line in response.content:
            if ttft is None and b'"content":"' in line:
                ttft = time.monotonic() - started
    return Answer(tenant, priority, started, ttft, time.monotonic(), 200)


async def closed_loop(
    url: str,
    tenant: str,
    streams: int,
    until: float,
    priority: str = "standard",
    pause_s: float = 0.0,
    stop: asyncio.Event | None = None,
) -> list[Answer]:
    """`streams` requests at a time for `tenant`, each replaced as it ends, until the deadline (or until
    `stop` is set)."""
    answers: list[Answer] = []

    async def one_stream(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < until and not (stop is not None and stop.is_set()):
            answer = await stream_once(session, url, tenant, priority)
            answers.append(answer)
            if answer.status != 200 or pause_s:
                await asyncio.sleep(max(pause_s, 0.05))

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        await asyncio.gather(*(one_stream(session) for _ in range(streams)))
    return answers


async def replica_counts(session: aiohttp.ClientSession, replica_url: str) -> tuple[int, int]:
    """What a replica itself reports on its /metrics: requests running, requests waiting."""
    async with session.get(f"{replica_url}/metrics") as response:
        found = parse_samples(await response.text(), {"vllm:num_requests_running", "vllm:num_requests_waiting"})
    return int(found.total("vllm:num_requests_running") or 0), int(found.total("vllm:num_requests_waiting") or 0)


def per_engine(server_url: str, name: str) -> dict[str, float]:
    """A vLLM server's counter `name` summed by its `engine` label (a data-parallel server's engines)."""
    samples = parse_samples(httpx.get(f"{server_url}/metrics", timeout=10).text, {name})
    totals: dict[str, float] = {}
    for labels, value in samples.by_name.get(name, ()):
        totals[labels.get("engine", "")] = totals.get(labels.get("engine", ""), 0.0) + value
    return totals


def spread_distinct(router_url: str, body: dict[str, Any], topic: str, count: int = 8) -> list[str]:
    """`count` chats with distinct prompts (no shared prefix) at once through the router, so placed by load;
    each must answer 200. The replicas that answered, in order (`x-dpserve-replica`). `topic` makes the prompts
    new to the engines (a prompt they cached already stores no new blocks, so sends no KV events)."""

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            chats = [{**body, "messages": [{"role": "user", "content": f"{topic} {i} " * 40}]} for i in range(count)]
            return await asyncio.gather(*(client.post(f"{router_url}/v1/chat/completions", json=c) for c in chats))

    answers = asyncio.run(send())
    assert [answer.status_code for answer in answers] == [200] * count
    return [answer.headers["x-dpserve-replica"] for answer in answers]
