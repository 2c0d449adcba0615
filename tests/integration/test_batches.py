"""The Batch API end to end with the official `openai` SDK: on the session's real vLLM CPU fleet, and on
simulator replicas for what needs many lines, a kill -9, tenants, cancels, windows, or two routers on one
real PostgreSQL server."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dpserve.replicas.prometheus_text import parse_samples
from dpserve.router.batch.follow import run_batch_command
from tests.conftest import free_port
from tests.integration.conftest import (
    Fleet,
    RouterProcess,
    bearer,
    router_status,
    running_sims,
    start_router,
    stop_router,
    wait_until,
)
from tests.postgres import running_postgres

CHAT = "/v1/chat/completions"
FINAL = ("completed", "failed", "expired", "cancelled")
# Sims slow enough that a batch runs for seconds (8 tokens at 4 ms each), so a router can be killed mid-way.
SLOW_SIM = ("--decode-ms-per-token", "4", "--prefill-ms-per-token", "0.02", "--max-num-seqs", "8")


def chat_line(custom_id: str, model: str, group: int, max_tokens: int = 8) -> dict[str, Any]:
    system = f"You answer questions of group {group}. " * 8
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {custom_id}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def run_batch(client: openai.OpenAI, lines: list[dict[str, Any]], window: str = "24h") -> Any:
    uploaded = client.files.create(file=("batch.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window=window)  # type: ignore[arg-type]


def wait_batch(client: openai.OpenAI, batch_id: str, timeout_s: float) -> Any:
    batch = client.batches.retrieve(batch_id)
    deadline = time.monotonic() + timeout_s
    while batch.status not in FINAL:
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout_s} s: {batch.request_counts}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch_id)
    return batch


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def finished_at_replicas(urls: list[str]) -> dict[str, float]:
    """vLLM's `request_success_total` over the replicas, by finished reason."""
    reasons: Counter[str] = Counter()
    for url in urls:
        samples = parse_samples(httpx.get(f"{url}/metrics").text, {"vllm:request_success_total"})
        for labels, value in samples.by_name.get("vllm:request_success_total", []):
            reasons[labels["finished_reason"]] += value
    return dict(reasons)


def completed_at_replicas(urls: list[str]) -> float:
    reasons = finished_at_replicas(urls)
    return reasons.get("stop", 0.0) + reasons.get("length", 0.0)


def test_sdk_round_trip_on_vllm_cpu_replicas(fleet: Fleet) -> None:
    """Upload, create, poll, download on the session's vLLM CPU replicas through `dpserve up`'s router: each
    custom_id once, each answer the replica's own 200 body; a bad line and an unknown model in the error file."""
    client = openai.OpenAI(base_url=f"{fleet.router_url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    lines = [chat_line(f"q-{index}", model, index % 3) for index in range(12)]
    lines.append({"custom_id": "wrong-url", "method": "POST", "url": "/v1/completions", "body": {"model": model}})
    lines.append(chat_line("no-such-model", "no-such-model", 0))
    before = completed_at_replicas(fleet.replica_urls)
    batch = wait_batch(client, run_batch(client, lines).id, 180)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (14, 12, 2)
    output, errors = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
    assert sorted(entry["custom_id"] for entry in output) == sorted(f"q-{index}" for index in range(12))
    for entry in output:
        response = entry["response"]
        assert response["status_code"] == 200 and entry["error"] is None
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == model
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] == 8
    by_id = {entry["custom_id"]: entry for entry in errors}
    assert set(by_id) == {"wrong-url", "no-such-model"}
    assert by_id["wrong-url"]["error"]["line"] == 13 and "line 13" in by_id["wrong-url"]["error"]["message"]
    assert by_id["no-such-model"]["response"]["status_code"] == 404
    assert batch.usage.output_tokens == 12 * 8
    # The replicas ran each good line once (the session's other tests are not running beside this one).
    assert completed_at_replicas(fleet.replica_urls) - before == 12
    listed = client.batches.list(limit=100).data
    assert batch.id in [item.id for item in listed]


@pytest.fixture(scope="module")
def slow_sims() -> Iterator[list[str]]:
    with running_sims(2, *SLOW_SIM) as sims:
        yield [sim.url for sim in sims]


def batch_router(sims: list[str], store: str, *extra: str, port: int | None = None) -> RouterProcess:
    return start_router(
        sims, "least_loaded", "--batch-store", store, "--batch-lease", "2", "--batch-slots", "2", *extra, port=port
    )


def test_bad_uploads_get_clear_errors(slow_sims: list[str], tmp_path: Path) -> None:
    router = batch_router(slow_sims, str(tmp_path / "store.sqlite3"), "--batch-file-max-bytes", "4096")
    try:
        files = f"{router.url}/v1/files"
        broken = jsonl([chat_line("a", "m", 0)]) + b"{not json\n"
        answer = httpx.post(files, files={"file": ("b.jsonl", broken)}, data={"purpose": "batch"})
        assert answer.status_code == 400 and "line 2: not JSON" in answer.json()["error"]["message"]
        answer = httpx.post(files, files={"file": ("b.jsonl", b'["a list"]\n')}, data={"purpose": "batch"})
        assert answer.status_code == 400 and "line 1: a JSON object is expected" in answer.json()["error"]["message"]
        big = jsonl([chat_line(str(index), "m", 0) for index in range(40)])
        answer = httpx.post(files, files={"file": ("b.jsonl", big)}, data={"purpose": "batch"})
        assert answer.status_code == 413 and answer.json()["error"]["code"] == "file_too_large"
        chunked = iter([b"--x\r\n"])  # no Content-Length: refused before anything is spooled
        answer = httpx.post(files, content=chunked, headers={"content-type": "multipart/form-data; boundary=x"})
        assert answer.status_code == 411 and answer.json()["error"]["code"] == "length_required"
        answer = httpx.post(files, files={"file": ("b.jsonl", b"")}, data={"purpose": "batch"})
        assert answer.status_code == 400 and "no requests" in answer.json()["error"]["message"]
        answer = httpx.post(files, files={"file": ("b.jsonl", jsonl([chat_line("a", "m", 0)]))}, data={"purpose": "x"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "purpose"
        batches = f"{router.url}/v1/batches"
        answer = httpx.post(batches, json={"input_file_id": "file-nope", "endpoint": CHAT, "completion_window": "24h"})
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "file_not_found"
        answer = httpx.post(batches, json={"input_file_id": "file-nope", "endpoint": "/v1/nope"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "endpoint"
        answer = httpx.post(batches, content=b"[")
        assert answer.status_code == 400
        answer = httpx.post(batches, json={"input_file_id": "f", "endpoint": CHAT, "completion_window": "soon"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "completion_window"
        assert httpx.get(f"{batches}/batch_nope").status_code == 404
        assert httpx.get(f"{files}/file-nope/content").status_code == 404
    finally:
        stop_router(router)


def test_tenants_see_only_their_own_and_cancel_keeps_what_finished(slow_sims: list[str], tmp_path: Path) -> None:
    keys = ["--api-key", "acme:acme-key-0001", "--api-key", "globex:globex-key-01", "--admin-key", "admin-key-0001"]
    router = start_router(
        slow_sims, "least_loaded", "--batch-store", str(tmp_path / "s.sqlite3"), "--batch-slots", "1", *keys,
        admin_key="admin-key-0001",
    )  # fmt: skip
    try:
        acme = openai.OpenAI(base_url=f"{router.url}/v1", api_key="acme-key-0001", max_retries=0)
        globex = openai.OpenAI(base_url=f"{router.url}/v1", api_key="globex-key-01", max_retries=0)
        batch = run_batch(acme, [chat_line(str(index), "dpserve-tiny", index % 2, 32) for index in range(200)])
        with pytest.raises(openai.NotFoundError):
            globex.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            globex.files.retrieve(batch.input_file_id)
        with pytest.raises(openai.NotFoundError):
            globex.batches.cancel(batch.id)
        assert globex.batches.list().data == [] and globex.files.list().data == []
        wait_until(lambda: acme.batches.retrieve(batch.id).request_counts.completed >= 5, 30, 0.1, "some lines done")
        assert acme.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        ended = wait_batch(acme, batch.id, 30)
        assert ended.status == "cancelled" and ended.cancelled_at is not None
        output = file_lines(acme, ended.output_file_id)
        assert 5 <= len(output) < 200 and len(output) == ended.request_counts.completed
        cancelled = [entry for entry in file_lines(acme, ended.error_file_id) if entry["error"]]
        assert {entry["error"]["code"] for entry in cancelled} == {"batch_cancelled"}
        assert len(output) + len(cancelled) == 200
        status = router_status(router.url, "admin-key-0001")["batches"]
        assert status["this_router"]["lines_done"] == len(output)
        metrics = httpx.get(f"{router.url}/metrics", headers=bearer("admin-key-0001")).text
        assert f'dpserve_batch_lines_ended_total{{outcome="completed"}} {float(len(output))}' in metrics
        # `dpserve batch`: the tenant's batches, and one batch to its end.
        shown: list[str] = []
        assert run_batch_command(router.url, "acme-key-0001", None, False, write=shown.append) == 0
        assert batch.id in shown[0] and "cancelled" in shown[0]
        assert run_batch_command(router.url, "acme-key-0001", batch.id, True, write=shown.append) == 0
        assert shown[1].startswith(f"{batch.id}  cancelled") and f"output file: {ended.output_file_id}" in shown[2]
        assert run_batch_command(router.url, "globex-key-01", batch.id, False, write=shown.append) == 1
        # The lines ran as acme's requests: its usage (what its quotas count) holds their tokens.
        usage = httpx.get(f"{router.url}/admin/usage", headers=bearer("admin-key-0001")).json()["tenants"]
        assert usage["acme"]["total"]["completion_tokens"] == 32 * len(output) and "globex" not in usage
        acme.files.delete(batch.input_file_id)
        with pytest.raises(openai.NotFoundError):
            acme.files.retrieve(batch.input_file_id)
    finally:
        stop_router(router)


def test_a_batch_past_its_window_expires_with_the_rest_reported(slow_sims: list[str], tmp_path: Path) -> None:
    router = batch_router(slow_sims, str(tmp_path / "s.sqlite3"))
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        lines = [chat_line(str(index), "dpserve-tiny", 0, 64) for index in range(400)]
        ended = wait_batch(client, run_batch(client, lines, window="3s").id, 30)
        assert ended.status == "expired" and ended.expired_at is not None
        output, errors = file_lines(client, ended.output_file_id), file_lines(client, ended.error_file_id)
        assert output and errors and len(output) + len(errors) == 400
        assert {entry["error"]["code"] for entry in errors} == {"batch_expired"}
    finally:
        stop_router(router)


def test_kill_9_mid_batch_then_restart_completes_each_line_once(slow_sims: list[str], tmp_path: Path) -> None:
    """The router dies (SIGKILL) mid-batch and is started again on the same store: the batch completes, each
    custom_id once in the output; the replicas completed each line once, besides those running at the kill
    (aborted there, and run again)."""
    store, port, count = str(tmp_path / "store.sqlite3"), free_port(), 300
    before = finished_at_replicas(slow_sims)
    router = batch_router(slow_sims, store, port=port)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    batch = run_batch(client, [chat_line(str(index), "dpserve-tiny", index % 5) for index in range(count)])
    try:
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= count // 3, 60, 0.05)
        router.process.send_signal(signal.SIGKILL)
        router.process.wait(10)
    finally:
        stop_router(router)
    restarted = batch_router(slow_sims, store, port=port)
    try:
        ended = wait_batch(client, batch.id, 120)
        assert ended.status == "completed" and ended.request_counts.completed == count
        output = file_lines(client, ended.output_file_id)
        assert sorted(int(entry["custom_id"]) for entry in output) == list(range(count))
        after = finished_at_replicas(slow_sims)
        completed = sum(after.get(reason, 0.0) - before.get(reason, 0.0) for reason in ("stop", "length"))
        aborted = after.get("abort", 0.0) - before.get("abort", 0.0)
        # Lines running at the kill were aborted at the replicas (the router's connections closed) and run again;
        # one that had just finished there, unrecorded, ran twice: never more than the lines running then.
        print(f"kill -9 mid-batch: {count} lines, the replicas completed {completed:g} and aborted {aborted:g}")
        assert count <= completed <= count + 4, (completed, aborted)
    finally:
        stop_router(restarted)


def test_a_router_stopped_mid_batch_hands_its_lines_back_at_once(slow_sims: list[str], tmp_path: Path) -> None:
    """SIGTERM mid-batch: the router gives its running lines back as it stops (each takes 2.4 s, longer than
    its drain), so the one started next on the store finishes the batch well within the claims' 60 s lease."""
    store, port, count = str(tmp_path / "store.sqlite3"), free_port(), 12
    lease = ("--batch-lease", "60")
    router = start_router(slow_sims, "least_loaded", "--batch-store", store, *lease, "--batch-slots", "2", port=port)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    batch = run_batch(client, [chat_line(str(index), "dpserve-tiny", 0, 600) for index in range(count)])
    try:

        def some_done_more_running() -> bool:
            mine = router_status(router.url)["batches"]["this_router"]
            return bool(mine["lines_done"] >= 2 and mine["running"] > 0)

        wait_until(some_done_more_running, 60, 0.05)
    finally:
        stop_router(router)
    restarted = start_router(slow_sims, "least_loaded", "--batch-store", store, *lease, port=port)
    try:
        started = time.monotonic()
        ended = wait_batch(client, batch.id, 40)
        assert ended.request_counts.completed == count and time.monotonic() - started < 40
        output = file_lines(client, ended.output_file_id)
        assert sorted(int(entry["custom_id"]) for entry in output) == list(range(count))
    finally:
        stop_router(restarted)


def test_two_peered_routers_on_one_postgresql_store_run_every_line_once(slow_sims: list[str]) -> None:
    count = 400
    with running_postgres() as url, contextlib.ExitStack() as stack:
        ports = [free_port(), free_port()]
        routers = []
        for index, port in enumerate(ports):
            peer = f"--peer=http://127.0.0.1:{ports[1 - index]}"
            routers.append(batch_router(slow_sims, url, peer, port=port))
            stack.callback(stop_router, routers[-1])
        before = completed_at_replicas(slow_sims)
        first = openai.OpenAI(base_url=f"{routers[0].url}/v1", api_key="unused", max_retries=0)
        second = openai.OpenAI(base_url=f"{routers[1].url}/v1", api_key="unused", max_retries=0)
        batch = run_batch(first, [chat_line(str(index), "dpserve-tiny", index % 7) for index in range(count)])
        ended = wait_batch(second, batch.id, 120)  # the other router sees the same batch
        assert ended.status == "completed" and ended.request_counts.completed == count
        output = file_lines(second, ended.output_file_id)
        assert sorted(int(entry["custom_id"]) for entry in output) == list(range(count))
        done = [router_status(router.url)["batches"]["this_router"]["lines_done"] for router in routers]
        assert sum(done) == count and min(done) > 0, done  # both ran lines, none twice
        assert completed_at_replicas(slow_sims) - before == count
