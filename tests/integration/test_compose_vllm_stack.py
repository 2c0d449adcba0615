"""The real vLLM CPU stack on the Docker engine: `make compose-up` (VARIANT=cpu: two vllm-cpu containers of the
tiny model, built here, and the router), the official SDK through the published port, and `docker stats` of
each container; and `make compose-down` while an answer streams through the router. 70 s here with the
replica image's dependency layer built (about 3 minutes when that layer is built first, from scratch longer);
in `make test`, as the README's headline deployment; alone: `pytest -m vllm_stack -s`."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from dpserve.deploy.compose import cpu_replica_image
from tests.integration.docker_stack import Stack, compose_stack, docker, needs_engine
from tests.integration.traffic import MODEL, long_prompt, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.vllm_stack]
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


@dataclass
class CpuStack:
    stack: Stack
    ready_s: float
    """From `make compose-up` until it returned: it waits for every healthcheck to pass (--wait)."""
    cached: bool
    """Whether the replica image was there before (else its build is in `ready_s`)."""


@pytest.fixture(scope="module")
def cpu_stack() -> Iterator[CpuStack]:
    """One stack for the module (it starts in a minute or more): the last test takes it down itself."""
    needs_engine()
    cached = subprocess.run(["docker", "image", "inspect", cpu_replica_image()], capture_output=True).returncode == 0
    started = time.monotonic()
    with compose_stack("cpu") as stack:
        yield CpuStack(stack, time.monotonic() - started, cached)


def test_vllm_cpu_stack_serves_the_sdk_through_the_router(cpu_stack: CpuStack) -> None:
    stack = cpu_stack.stack
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [model.id for model in client.models.list()] == [MODEL]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8
    )
    assert reply.usage and reply.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream it"}], max_tokens=8, stream=True
    )
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) >= 1
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert completion.choices[0].text
    # Chat prompts share the template's prefix, so kv_aware keeps them on one replica; long plain prompts
    # (several of vLLM's 128-token CPU blocks: it reports a block once full) with different first words
    # share nothing and go to either (ties at random), until both have published.
    for word in WORDS:
        if all(replica["kv_events"]["batches"] > 0 for replica in stack.status()["replicas"]):
            break
        client.completions.create(model=MODEL, prompt=long_prompt(word), max_tokens=4)

    def every_replica_publishes() -> bool:
        replicas = stack.status()["replicas"]
        return len(replicas) == 2 and all(r["healthy"] and r["kv_events"]["batches"] > 0 for r in replicas)

    try:
        wait_for(every_replica_publishes, 30, "KV events from both vLLM containers")
    except AssertionError:
        raise AssertionError(json.dumps(stack.status()["replicas"], indent=1)) from None
    stats = [
        json.loads(line)
        for line in docker("stats", "--no-stream", "--format", "{{json .}}").splitlines()
        if stack.project in line
    ]
    services = sorted(entry["Name"].removeprefix(f"{stack.project}-").rsplit("-", 1)[0] for entry in stats)
    assert services == ["router", "vllm-0", "vllm-1"]  # no GPU, no agent
    built = "images already built" if cpu_stack.cached else "replica image built first"
    print(f"\nvLLM CPU stack ready in {cpu_stack.ready_s:.0f}s from make compose-up ({built})")
    for entry in sorted(stats, key=lambda entry: entry["Name"]):
        print(f"  {entry['Name']}: CPU {entry['CPUPerc']}, memory {entry['MemUsage']}, PIDs {entry['PIDs']}")
    for replica in stack.status()["replicas"]:
        print(f"  {replica['id']} {replica['url']}: served {replica['served_total']}, kv {replica['kv_events']}")


STREAMED_TOKENS = 300
"""An answer of about 10 s from the tiny model on 2 busy cores: well inside the router's 30 s drain."""


def _stream_completion(url: str, tokens: int, seen: dict[str, Any]) -> None:
    """A streamed completion through the router, `tokens` long whatever the model says (ignore_eos), each event
    counted in `seen` as it arrives, and the tokens its usage counts. (Not one event per token: vLLM holds
    back a token whose text is an incomplete character and sends it with the next.)"""
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen.update(chunks=0, finish_reason=None, done=False, completion_tokens=0)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            seen["status"] = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    seen["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line.removeprefix("data: "))
                    if event.get("usage"):
                        seen["completion_tokens"] = event["usage"]["completion_tokens"]
                    for choice in event["choices"]:
                        seen["chunks"] += 1
                        seen["finish_reason"] = choice.get("finish_reason") or seen["finish_reason"]
    except httpx.HTTPError as exc:
        seen["error"] = repr(exc)
    seen["ended"] = time.monotonic()


def test_compose_down_lets_a_streamed_answer_finish_and_leaves_nothing_running(cpu_stack: CpuStack) -> None:
    """`docker compose down` mid-answer: the router (stopped first: it depends on the replicas) drains while the
    replicas keep serving; the answer completes to [DONE], then every container, network and volume is gone.
    The module's stack, after the test above (so it is last in this file)."""
    stack = cpu_stack.stack
    seen: dict[str, Any] = {}
    streaming = threading.Thread(target=_stream_completion, args=(stack.url, STREAMED_TOKENS, seen), daemon=True)
    streaming.start()
    wait_for(lambda: seen.get("chunks", 0) >= 10, 120, "the answer's first tokens through the router")
    at_down = seen["chunks"]
    started = time.monotonic()
    stack.make("compose-down", timeout_s=300)
    down_s = time.monotonic() - started
    streaming.join(60)
    assert "error" not in seen and seen["status"] == 200, seen
    assert seen["done"] and seen["finish_reason"] == "length" and seen["completion_tokens"] == STREAMED_TOKENS, seen
    assert at_down < STREAMED_TOKENS and seen["ended"] < started + down_s  # it streamed on during the stop
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
    print(
        f"\ncompose down at token {at_down}/{STREAMED_TOKENS}: the answer finished "
        f"{seen['ended'] - started:.1f}s later ({seen['finish_reason']}, [DONE]); down took {down_s:.1f}s"
    )
