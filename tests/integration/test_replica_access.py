"""Keys and TLS from the router to its replicas, against one real vLLM CPU replica that guards itself both
ways: `--api-key`, and TLS (`--ssl-keyfile/--ssl-certfile`) that requires a client certificate signed by the
test CA (`--ssl-ca-certs`, `--ssl-cert-reqs 2`). One replica serves every case (it starts once, for the module):
a router given the key, the CA and a client certificate uses it for chat, streams, /tokenize and a LoRA load;
a router without the key, or without the CA, answers 502 naming it and shows it misconfigured in /status.

`dpserve up` without any key given (its vLLM replica answers its router only) is tested on the keyed fleet of
tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from dpserve.replicas.prometheus_text import parse_samples
from dpserve.tiny_lora import build_tiny_loras
from dpserve.tiny_model import TINY_MODEL_NAME, ensure_tiny_model
from dpserve.up.plan import VLLM_SERVER_MODULE
from tests.conftest import free_port
from tests.integration.conftest import (
    FLEET_START_TIMEOUT_S,
    VLLM_TEST_FLAGS,
    RouterProcess,
    answers,
    bearer,
    router_status,
    start_router,
    stop_process,
    stop_router,
    wait_until,
)
from tests.tls_certs import TlsFiles, make_tls_files

pytestmark = pytest.mark.integration

KEY = secrets.token_hex(24)  # hex: never a leading `-` that argparse would take for a flag
ADAPTER = "tiny-lora-0"
CHAT = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
MISCONFIGURED_WITHIN_S = 10.0
PROMPT_TOKENS = "dpserve_routing_prompt_tokens_total"
TOKENIZE_FAILURES = "dpserve_routing_tokenize_failures_total"


@dataclass
class GuardedReplica:
    url: str
    pki: TlsFiles
    key_file: Path
    adapter: Path
    log_path: Path

    def client(self) -> httpx.Client:
        """A client the replica's TLS accepts (the CA, the client certificate), without its key."""
        return httpx.Client(verify=self.pki.client_context(with_client_cert=True), timeout=60)

    def tls_flags(self, *, ca: bool = True) -> list[str]:
        flags = ["--replica-ssl-certfile", str(self.pki.client_cert), "--replica-ssl-keyfile", str(self.pki.client_key)]
        return [*flags, "--replica-ssl-ca-certs", str(self.pki.ca_cert)] if ca else flags


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardedReplica]:
    work = tmp_path_factory.mktemp("guarded")
    pki = make_tls_files(work / "pki")
    model = ensure_tiny_model(work / "cache")
    (adapter,) = build_tiny_loras(work / "adapters", model, 1)
    key_file = work / "replica.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    port = free_port()
    command = [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", str(model), "--served-model-name", TINY_MODEL_NAME]
    command += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--api-key", KEY]
    command += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"]
    command += ["--ssl-keyfile", str(pki.server_key), "--ssl-certfile", str(pki.server_cert)]
    command += ["--ssl-ca-certs", str(pki.ca_cert), "--ssl-cert-reqs", "2", *VLLM_TEST_FLAGS]  # 2: CERT_REQUIRED
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    }
    log_path = work / "vllm.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    found = GuardedReplica(f"https://127.0.0.1:{port}", pki, key_file, adapter, log_path)
    try:
        deadline = time.monotonic() + FLEET_START_TIMEOUT_S
        while not _answers(found):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the guarded vLLM replica did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield found
    finally:
        stop_process(process, 30)


def _answers(replica: GuardedReplica) -> bool:
    try:
        with replica.client() as client:
            return client.get(f"{replica.url}/health").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def keyed_router(replica: GuardedReplica) -> Iterator[RouterProcess]:
    """Given the key (in a file), the CA and a client certificate; kv_aware tokenizes prompts on the replica."""
    router = start_router(
        [f"r0={replica.url}"],
        "kv_aware",
        "--tokenizer", "remote",
        "--replica-api-key-file", str(replica.key_file),
        *replica.tls_flags(),
        "--lora", f"{ADAPTER}={replica.adapter}",
        "--log-level", "debug", "--access-log", "--log-format", "json",
    )  # fmt: skip
    yield router
    stop_router(router)


def test_the_replica_answers_401_without_its_key(replica: GuardedReplica) -> None:
    with replica.client() as client:
        assert client.post(f"{replica.url}/v1/chat/completions", json=CHAT).status_code == 401
        assert client.get(f"{replica.url}/v1/models").status_code == 401
        assert client.get(f"{replica.url}/v1/models", headers=bearer(KEY)).status_code == 200


def test_with_the_key_and_tls_chat_streams_tokenize_and_a_lora_load_succeed(
    replica: GuardedReplica, keyed_router: RouterProcess
) -> None:
    url = keyed_router.url
    answer = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-dpserve-replica"] == "r0"
    assert answer.json()["choices"][0]["message"]["content"] is not None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2
    tokens = httpx.post(f"{url}/tokenize", json={"model": TINY_MODEL_NAME, "prompt": "hello world"}, timeout=60)
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["tokens"]
    # kv_aware tokenized the chats' prompts on the replica (its /tokenize, through the router's own session).
    metrics = parse_samples(httpx.get(f"{url}/metrics", timeout=10).text, {PROMPT_TOKENS, TOKENIZE_FAILURES})
    assert (metrics.total(PROMPT_TOKENS) or 0) > 0 and metrics.total(TOKENIZE_FAILURES) == 0
    lora = httpx.post(f"{url}/v1/completions", json={"model": ADAPTER, "prompt": "hi", "max_tokens": 4}, timeout=120)
    assert lora.status_code == 200, lora.text
    with replica.client() as client:
        listed = client.get(f"{replica.url}/v1/models", headers=bearer(KEY)).json()["data"]
    assert ADAPTER in {card["id"] for card in listed}  # loaded there by the router, behind the key
    status = router_status(url)
    (r0,) = status["replicas"]
    assert r0["state"] == "healthy" and r0["misconfigured"] is None


def test_the_key_is_in_no_log_line_status_receipt_or_metric(keyed_router: RouterProcess) -> None:
    url = keyed_router.url
    answer = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"x-dpserve-receipt": "1"}, timeout=60)
    assert answer.status_code == 200
    shown = [
        httpx.get(f"{url}/status", timeout=10).text,
        httpx.get(f"{url}/metrics", timeout=10).text,
        httpx.get(f"{url}/admin/receipts", timeout=10).text,
        httpx.get(f"{url}/admin/replicas", timeout=10).text,
        keyed_router.log(),
    ]
    assert answer.headers["x-request-id"] in shown[2]  # its receipt is there
    assert "loaded adapter tiny-lora-0" in shown[4] and '"status":200' in shown[4]  # its log and access log
    assert not [text for text in shown if KEY in text]


def _misconfigured_within(router: RouterProcess, started: float) -> tuple[httpx.Response, dict[str, object], float]:
    """The first answer to a chat that is not a 503 (the replica not probed yet), /status's replica, the time
    since `started`. `start_router` returns at once for no healthy replica: the router may not listen yet."""
    wait_until(lambda: answers(f"{router.url}/health"), MISCONFIGURED_WITHIN_S, 0.1, "the router")
    answer = httpx.post(f"{router.url}/v1/chat/completions", json=CHAT, timeout=30)
    while answer.status_code == 503 and time.monotonic() - started < MISCONFIGURED_WITHIN_S:
        time.sleep(0.2)
        answer = httpx.post(f"{router.url}/v1/chat/completions", json=CHAT, timeout=30)
    took = time.monotonic() - started
    (replica,) = router_status(router.url)["replicas"]
    return answer, replica, took


def test_a_router_without_the_key_answers_502_naming_the_replica(replica: GuardedReplica) -> None:
    started = time.monotonic()
    router = start_router([f"r0={replica.url}"], "least_loaded", *replica.tls_flags(), expect_healthy=0)
    try:
        answer, status, took = _misconfigured_within(router, started)
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert error["code"] == "replica_misconfigured" and error["type"] == "server_error"
        assert "replica r0" in error["message"] and "refused the router's key (HTTP 401)" in error["message"]
        assert took < MISCONFIGURED_WITHIN_S
        assert status["state"] == "misconfigured" and "HTTP 401" in str(status["misconfigured"])
        # Still misconfigured on later probes (read again each one), never routed to: 502 again, not a 401.
        time.sleep(1)
        again = httpx.post(f"{router.url}/v1/chat/completions", json=CHAT, timeout=30)
        assert again.status_code == 502 and again.json()["error"]["code"] == "replica_misconfigured"
    finally:
        log = stop_router(router)
    assert "r0 is misconfigured" in log
    print(f"\nwithout the key: 502 naming r0 {took:.2f} s after the router's start")


def test_a_router_without_the_ca_refuses_the_replicas_certificate(replica: GuardedReplica) -> None:
    started = time.monotonic()
    flags = ["--replica-api-key-file", str(replica.key_file), *replica.tls_flags(ca=False)]
    router = start_router([f"r0={replica.url}"], "least_loaded", *flags, expect_healthy=0)
    try:
        answer, status, took = _misconfigured_within(router, started)
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert error["code"] == "replica_misconfigured"
        assert "replica r0" in error["message"] and "certificate failed verification" in error["message"]
        assert took < MISCONFIGURED_WITHIN_S
        assert status["state"] == "misconfigured" and "--replica-ssl-ca-certs" in str(status["misconfigured"])
    finally:
        stop_router(router)
    print(f"\nwithout the CA: 502 naming r0 {took:.2f} s after the router's start")
