"""One real fleet per test session: `dpserve up` with 2 vLLM CPU replicas of the tiny model and its router.

Starting vLLM takes about a minute, so every integration test shares this fleet; tests that need
another policy start their own `dpserve router` over the same replicas (that takes a second)."""

from __future__ import annotations

import contextlib
import csv
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.otlp_receiver import OtlpReceiver
from dpserve.up.plan import VLLM_SERVER_MODULE
from dpserve.up.process import terminate
from tests.conftest import free_port, free_port_range

FLEET_START_TIMEOUT_S = 600
FLEET_MAX_LORAS = 2
REPLICA_ENV = {
    # Stored responses (`store`), so retrieving one by id can be tested; vLLM keeps them in memory.
    "VLLM_ENABLE_RESPONSES_API_STORE": "1",
    # vLLM's engine endpoints (/reset_prefix_cache, /is_sleeping, ...), which the admin API relays.
    "VLLM_SERVER_DEV_MODE": "1",
    # A tracing replica (the session fleet's: `fleet_traces`) exports its spans within 0.1 s, not the SDK's 5 s.
    "OTEL_BSP_SCHEDULE_DELAY": "100",
}
ROUTER_START_TIMEOUT_S = 30
# Every vLLM the tests start runs eager: torch.compile costs each start 20-40 s on these 2 cores (a cold compile
# cache, as on a fresh CI machine: 67 s to /health against 25 s eager), and the tiny model gains nothing the
# tests look at from it. The HTTP server, scheduler, KV events and metrics are the same.
VLLM_TEST_FLAGS = ("--enforce-eager",)


@dataclass
class Fleet:
    router_url: str
    replica_urls: list[str]
    kv_event_endpoints: list[str]
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


@dataclass
class RouterProcess:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        """What the router wrote to stderr (a file, not a pipe: a full pipe would stall a chatty router)."""
        return self.log_path.read_text(errors="replace")


def wait_until(
    predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.5, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def locust_stats(prefix: Path) -> dict[tuple[str, str], dict[str, str]]:
    """Locust's `--csv PREFIX` statistics, by (Type, Name)."""
    with open(f"{prefix}_stats.csv", newline="") as handle:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(handle)}


def bearer(key: str | None) -> dict[str, str]:
    """The header a client sends its API key in (none for no key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def router_status(url: str, admin_key: str | None = None, tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """`tls`: the client's context for a router serving HTTPS (`url` is then https://)."""
    return httpx.get(f"{url}/status", timeout=5, headers=bearer(admin_key), verify=tls or True).json()


def healthy_count(url: str, admin_key: str | None = None, tls: ssl.SSLContext | None = None) -> int:
    try:
        return sum(1 for replica in router_status(url, admin_key, tls)["replicas"] if replica["healthy"])
    except httpx.HTTPError:
        return 0


def router_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def running_fleet(
    work: Path,
    count: int,
    up_args: list[str],
    timeout_s: float,
    open_replicas: bool = True,
    serving: int | None = None,
) -> Iterator[Fleet]:
    """`dpserve up` with `count` replicas on free loopback ports, stopped (SIGTERM) when the block ends.
    `open_replicas`: without a key (`--no-replica-key`), as tests that start their own routers over them and read
    them directly need; else keyed, for the fleet's own routers only. `serving`: how many serve when it is
    ready (elastic fleets: their --min-replicas; 0: once the router is ready); all `count` by default."""
    router_port = free_port()
    base_port = free_port_range(count)
    kv_base_port = free_port_range(count, start=base_port + count + 100)
    log_path = work / "dpserve-up.log"
    command = [sys.executable, "-m", "dpserve", "up", "--port", str(router_port), "--base-port", str(base_port)]
    command += ["--kv-events-base-port", str(kv_base_port), "--run-dir", str(work / "run"), "--probe-interval", "0.5"]
    if open_replicas:  # a keyed `dpserve up` is tested in test_tensor_parallel.py
        command.append("--no-replica-key")
    command += up_args
    if "--sim" not in up_args:  # what follows `--` goes to every vLLM replica
        command += [*([] if "--" in up_args else ["--"]), *VLLM_TEST_FLAGS]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **REPLICA_ENV})
    fleet = Fleet(
        router_url=f"http://127.0.0.1:{router_port}",
        replica_urls=[f"http://127.0.0.1:{base_port + index}" for index in range(count)],
        kv_event_endpoints=[f"tcp://127.0.0.1:{kv_base_port + index}" for index in range(count)],
        process=process,
        log_path=log_path,
    )
    try:
        deadline = time.monotonic() + timeout_s
        wanted = count if serving is None else serving
        while healthy_count(fleet.router_url) < wanted or (wanted == 0 and not router_ready(fleet.router_url)):
            if process.poll() is not None:
                pytest.fail(f"dpserve up exited with {process.returncode}:\n{fleet.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"fleet not ready after {timeout_s}s:\n{fleet.log_tail()}")
            time.sleep(0.5)
        yield fleet
    finally:
        if process.poll() is None:
            stop_process(process, 90)


@pytest.fixture(scope="session")
def fleet_traces() -> Iterator[OtlpReceiver]:
    """An OTLP receiver the session fleet's vLLM replicas export their spans to (test_tracing.py reads them),
    so no test starts a vLLM of its own only to trace it."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory, fleet_traces: OtlpReceiver) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("fleet")
    # LoRA on, as in fleets serving adapters (test_lora.py loads them through its own router).
    lora = ["--enable-lora", "--max-loras", str(FLEET_MAX_LORAS), "--max-lora-rank", "8"]
    up_args = ["--replicas", "2", "--cache-dir", str(work / "cache"), *lora]
    with running_fleet(
        work, 2, [*up_args, "--", "--otlp-traces-endpoint", fleet_traces.endpoint], FLEET_START_TIMEOUT_S
    ) as fleet:
        yield fleet


@dataclass
class SimProcess:
    url: str
    kv_events: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def running_sim(*args: str) -> Iterator[SimProcess]:
    """One `dpserve sim` on free loopback ports, publishing KV events, until the block ends."""
    port, kv_port = free_port(), free_port()
    kv_events = f"tcp://127.0.0.1:{kv_port}"
    process = subprocess.Popen(sim_command(port, kv_events, *args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sim = SimProcess(f"http://127.0.0.1:{port}", kv_events, process)
    try:
        wait_until(lambda: answers(f"{sim.url}/health") or process.poll() is not None, 30, 0.1, "sim")
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else "sim exited"
        yield sim
    finally:
        stop_process(process, 10)


@contextlib.contextmanager
def running_sims(count: int, *args: str, timeout_s: float = 60) -> Iterator[list[SimProcess]]:
    """`dpserve sim --count COUNT`: COUNT replicas in one process, on consecutive free loopback ports, until the
    block ends; replica I publishes KV events on the first KV port + I (its `kv_events`, unless `args` give
    --data-parallel-size). They share one `process`: stopping it stops them all."""
    port = free_port_range(count)
    kv_port = free_port_range(count, start=port + count)
    command = [*sim_command(port, f"tcp://127.0.0.1:{kv_port}", *args), "--count", str(count)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sims = [SimProcess(f"http://127.0.0.1:{port + i}", f"tcp://127.0.0.1:{kv_port + i}", process) for i in range(count)]
    last = f"{sims[-1].url}/health"  # the ports start listening in order
    try:
        wait_until(lambda: answers(last) or process.poll() is not None, timeout_s, 0.1, "sims")
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else "sims exited"
        yield sims
    finally:
        stop_process(process, 10)


@contextlib.contextmanager
def kv_router_over_sims(count: int, sim_args: Sequence[str], *router_args: str) -> Iterator[RouterProcess]:
    """`count` sims publishing KV events (each with `sim_args`), and a kv_aware router over them that reads
    the events and tokenizes on the replicas; the router is stopped (and its files written) on the way out."""
    with contextlib.ExitStack() as stack:
        sims = [stack.enter_context(running_sim(*sim_args)) for _ in range(count)]
        events = [f"--kv-events={sim.url}={sim.kv_events}" for sim in sims]
        router = start_router([sim.url for sim in sims], "kv_aware", *events, "--tokenizer", "remote", *router_args)
        try:
            yield router
        finally:
            stop_router(router)


def sim_command(port: int, kv_events: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "dpserve", "sim", "--port", str(port), "--kv-events", kv_events, *args]


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_router(
    replica_urls: list[str],
    policy: str,
    *extra: str,
    expect_healthy: int | None = None,
    admin_key: str | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
    tls: ssl.SSLContext | None = None,
) -> RouterProcess:
    """`admin_key`: the router's, when it has keys (its /status then needs it). `port`: one chosen
    beforehand (routers that name each other as peers), else a free one. `tls`: the client's context
    for a router serving HTTPS (its url is https://)."""
    port = port or free_port()
    command = [sys.executable, "-m", "dpserve", "router", "--policy", policy, "--host", host, "--port", str(port)]
    for index, spec in enumerate(replica_urls):
        # Named r0, r1, ... in the order given, as `dpserve up` names its own; a spec with a name keeps it.
        named = "://" in spec.partition("=")[2]
        command += ["--replica", spec if named else f"r{index}={spec}"]
    command += ["--probe-interval", "0.2", "--log-level", "warning", *extra]
    with tempfile.NamedTemporaryFile(prefix="dpserve-router-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    router = RouterProcess(f"{'https' if tls else 'http'}://{host}:{port}", process, Path(log.name))
    try:
        expected = len(replica_urls) if expect_healthy is None else expect_healthy
        wait_until(lambda: healthy_count(router.url, admin_key, tls) == expected, ROUTER_START_TIMEOUT_S, what="router")
    except AssertionError:
        stop_router(router)
        raise
    return router


@contextlib.contextmanager
def vllm_replica(model: Path, name: str, log: Path, *args: str) -> Iterator[str]:
    """One real vLLM replica of `model` served as `name`, with `args` (a pooling runner, a scheduling policy),
    on a free loopback port; its URL at once (wait for its /health), stopped when the block ends."""
    port = free_port()
    command = [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", str(model), "--served-model-name", name]
    command += ["--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port), *VLLM_TEST_FLAGS, *args]
    env = {**os.environ, **REPLICA_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(process, 60)


def stop_router(router: RouterProcess) -> str:
    """Stops the router; returns what it logged."""
    stop_process(router.process, 30)
    log = router.log()
    with contextlib.suppress(OSError):
        router.log_path.unlink()
    return log


stop_process = terminate


def checkout_files(destination: Path) -> Path:
    """A copy of the checkout's files as git knows them (committed or not, less the ignored): what a clone
    holds, without the .venv, caches and build outputs this checkout has gathered."""
    root = Path(__file__).resolve().parents[2]
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = root / os.fsdecode(name)
        if source.is_file():  # a file deleted but not yet committed is listed too
            target = destination / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


RouterFactory = Callable[..., RouterProcess]


@pytest.fixture
def router_factory(fleet: Fleet) -> Iterator[RouterFactory]:
    started: list[RouterProcess] = []

    def make(policy: str, *extra: str) -> RouterProcess:
        router = start_router(fleet.replica_urls, policy, *extra)
        started.append(router)
        return router

    yield make
    for router in started:
        stop_router(router)


@contextlib.contextmanager
def torch_index(wheel: Path, directory: Path) -> Iterator[str]:
    """A package index on loopback holding that one wheel (a plain directory listing, which pip reads as a
    simple index's page); yields its URL."""
    project = directory / "torch"
    project.mkdir(parents=True)
    (project / wheel.name).symlink_to(wheel)
    port = free_port_range(1)
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
        cwd=directory,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_until(lambda: answers(url + "torch/"), 20, 0.2, "the local torch index")
        yield url
    finally:
        server.terminate()
        server.wait(10)


ONE_SEQ_MODEL = "tiny-one-seq"


@pytest.fixture(scope="session")
def one_seq_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real vLLM replica that runs one sequence at a time (`--max-num-seqs 1`), so a second request waits in
    vLLM's own scheduler; priority scheduling (equal classes are first come, first served) and no prefix cache,
    so every prompt token it computes shows in `vllm:prompt_tokens_total`."""
    from dpserve.tiny_model import ensure_tiny_model

    work = tmp_path_factory.mktemp("one-seq")
    model = ensure_tiny_model(work / "cache")
    args = ("--scheduling-policy", "priority", "--max-num-seqs", "1", "--no-enable-prefix-caching")
    with vllm_replica(model, ONE_SEQ_MODEL, work / "vllm.log", *args, "--max-model-len", "4096") as url:
        wait_until(lambda: answers(f"{url}/health"), 300, what=f"vllm (log: {work / 'vllm.log'})")
        yield url
