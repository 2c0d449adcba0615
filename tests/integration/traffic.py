"""Client traffic for the integration tests that change a fleet under load: a chat, a long prompt, a steady
load of non-streaming requests whose every outcome is kept, and a wait that says what it waited for."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "dpserve-tiny"


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
