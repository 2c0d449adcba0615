"""Secrets rotated live, under load: the router reads its key files again within seconds of a change, without a
restart, and no request is dropped on the way.

Client keys: while clients keep calling with the old key and the new one, and long streams started with the old
key run on, `--api-key-file` is rewritten: the old key is refused and the new one accepted within 5 s, every
answer is a 200 or (a key not in force) a 401, and the streams end whole.

The replicas' key: two replicas (`dpserve sim`, which checks a key as vLLM's `--api-key` does) are restarted one
by one with a new key while closed-loop load runs through the router, whose `--replica-api-key-file` is changed
once the first is back (the operator's cue: /status shows it reachable, refusing the key in force): every request
is answered 200 (a replica refusing the key in force is left for the other, and taken back once the file says
its key)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.integration.conftest import (
    answers,
    healthy_count,
    router_status,
    sim_command,
    start_router,
    stop_process,
    stop_router,
    wait_until,
)

pytestmark = pytest.mark.integration

OLD_KEY, NEW_KEY = "old-client-key-0001", "new-client-key-0002"
ROTATION_S = 5.0
SIM_ARGS = ("--decode-ms-per-token", "2", "--seed", "7")


@dataclass
class Answer:
    at: float
    key: str
    status: int


def ask(url: str, key: str, max_tokens: int = 4, stream: bool = False) -> httpx.Response:
    body = {"prompt": "hello", "max_tokens": max_tokens, "stream": stream}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def refuses_the_key(router: str, name: str) -> bool:
    """The replica answers its probes but refuses the router's key."""
    found = [replica for replica in router_status(router)["replicas"] if replica["id"] == name]
    return bool(found) and found[0]["reachable"] and found[0]["misconfigured"] is not None


@contextlib.contextmanager
def sim_on(port: int, key: str) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "VLLM_API_KEY": key}
    command = sim_command(port, f"tcp://127.0.0.1:{free_port()}", *SIM_ARGS)
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/health"), 30, 0.05, "sim")
        yield process
    finally:
        stop_process(process, 10)


def test_a_client_key_file_changed_under_load_swaps_the_keys_within_5_s_and_drops_nothing(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# the team's keys\nteam:{OLD_KEY}\n")
    port = free_port()
    with sim_on(port, "") as _:
        keys = ("--api-key-file", str(key_file), "--admin-key", "admin-key-01")
        router = start_router([f"http://127.0.0.1:{port}"], "least_loaded", *keys, admin_key="admin-key-01")
        answers_seen: list[Answer] = []
        streams_whole: list[bool] = []
        stop = threading.Event()

        def load(key: str) -> None:
            while not stop.is_set():
                answers_seen.append(Answer(time.monotonic(), key, ask(router.url, key).status_code))

        def long_stream() -> None:
            answer = ask(router.url, OLD_KEY, max_tokens=1500, stream=True)  # ~3 s of tokens at 2 ms each
            streams_whole.append(answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]"))

        try:
            threads = [threading.Thread(target=load, args=(key,)) for key in (OLD_KEY, NEW_KEY, OLD_KEY, NEW_KEY)]
            threads += [threading.Thread(target=long_stream) for _ in range(3)]
            for thread in threads:
                thread.start()
            time.sleep(1.0)  # load before the change
            changed_at = time.monotonic()
            key_file.write_text(f"team:{NEW_KEY}\n")
            wait_until(lambda: ask(router.url, NEW_KEY).status_code == 200, ROTATION_S, 0.05, "new key accepted")
            wait_until(lambda: ask(router.url, OLD_KEY).status_code == 401, ROTATION_S, 0.05, "old key refused")
            swapped_at = time.monotonic()
            time.sleep(1.0)  # load after the change
            stop.set()
            for thread in threads:
                thread.join(60)
        finally:
            stop_router(router)
    print(f"keys swapped {swapped_at - changed_at:.2f} s after the file changed; {len(answers_seen)} answers")
    assert {answer.status for answer in answers_seen} <= {200, 401}
    before = [a for a in answers_seen if a.at < changed_at]
    after = [a for a in answers_seen if a.at > swapped_at]
    assert before and after
    assert all(a.status == (200 if a.key == OLD_KEY else 401) for a in before)
    assert all(a.status == (200 if a.key == NEW_KEY else 401) for a in after), [
        (a.at - swapped_at, a.key, a.status) for a in after
    ]
    assert streams_whole == [True, True, True]


def test_the_replicas_key_rotated_replica_by_replica_under_load_fails_no_request(tmp_path: Path) -> None:
    key_file = tmp_path / "replica-key"
    key_file.write_text("replica-key-one\n")
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    statuses: list[int] = []
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(contextlib.ExitStack())
        first.enter_context(sim_on(ports[0], "replica-key-one"))
        second = stack.enter_context(contextlib.ExitStack())
        second.enter_context(sim_on(ports[1], "replica-key-one"))
        router = start_router(urls, "least_loaded", "--replica-api-key-file", str(key_file))
        stack.callback(stop_router, router)

        def load() -> None:
            while not stop.is_set():
                try:
                    statuses.append(ask(router.url, "none").status_code)
                except httpx.HTTPError:
                    statuses.append(0)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(0.5)
            first.close()  # the first replica restarts with the new key: it refuses the router's old one
            first.enter_context(sim_on(ports[0], "replica-key-two"))
            # What the operator waits for: the router sees it back (reachable), refusing the key still in force.
            wait_until(lambda: refuses_the_key(router.url, "r0"), ROTATION_S, 0.05, "the first replica back")
            key_file.write_text("replica-key-two\n")
            wait_until(lambda: refuses_the_key(router.url, "r1"), ROTATION_S, 0.05, "the change seen")
            second.close()
            second.enter_context(sim_on(ports[1], "replica-key-two"))
            wait_until(lambda: healthy_count(router.url) == 2, ROTATION_S * 2, 0.05, "both replicas with the new key")
            time.sleep(0.5)
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
    failed = [status for status in statuses if status != 200]
    print(f"{len(statuses)} requests, {len(failed)} failed: {failed[:10]}")
    assert statuses and not failed
