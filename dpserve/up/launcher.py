"""`dpserve up`: start the replicas, wait until they serve, start the router, keep them all alive."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import aiohttp

from dpserve.config import UpSettings
from dpserve.gpu.nvml import count_nvidia_gpus
from dpserve.router.access import check_bind, load_keys
from dpserve.text_table import format_table
from dpserve.up.plan import (
    PlanError,
    ReplicaPlan,
    events_known,
    plan_replicas,
    plan_sims,
    router_argv,
    router_env,
)
from dpserve.up.process import ManagedProcess, log_tail

log = logging.getLogger("dpserve.up")
STOP_GRACE_S = 30.0


class StartupFailed(RuntimeError):
    pass


TABLE_HEADER = ("REPLICA", "URL", "DEVICE", "STATE", "PID", "LOG")


class Launcher:
    def __init__(
        self, settings: UpSettings, plans: list[ReplicaPlan], run_dir: Path, tokenizer: str | None = None
    ) -> None:
        self.settings = settings
        self.plans = plans
        self.run_dir = run_dir
        self.replicas = [
            ManagedProcess(plan.id, plan.argv, plan.env, run_dir / f"{plan.id}.log", plan.cpus) for plan in plans
        ]
        self.router = ManagedProcess(
            "router", router_argv(settings, plans, tokenizer), router_env(settings.router), None
        )
        self.stopping = asyncio.Event()
        self._started = False

    @property
    def router_url(self) -> str:
        host = "127.0.0.1" if self.settings.router.host in ("0.0.0.0", "::", "") else self.settings.router.host
        return f"http://{host}:{self.settings.router.port}"

    @property
    def policy(self) -> str:
        return self.settings.router.policy or ("kv_aware" if events_known(self.settings) else "least_loaded")

    def table(self) -> str:
        rows = [
            (plan.id, plan.url, plan.device, proc.state, str(proc.pid or "-"), str(proc.log_path))
            for plan, proc in zip(self.plans, self.replicas, strict=True)
        ]
        rows.append(
            (
                "router",
                self.router_url,
                f"policy={self.policy}",
                self.router.state,
                str(self.router.pid or "-"),
                "(this terminal)",
            )
        )
        return format_table(TABLE_HEADER, rows)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        try:
            return await self._run()
        finally:
            await self.shutdown()

    async def _run(self) -> int:
        print(f"dpserve: starting {len(self.plans)} replica(s); logs in {self.run_dir}", flush=True)
        for proc in self.replicas:
            await proc.start()
        async with aiohttp.ClientSession() as session:
            try:
                waits = [
                    self._wait_ready(session, plan.url, proc)
                    for plan, proc in zip(self.plans, self.replicas, strict=True)
                ]
                if not await self._unless_stopping(asyncio.gather(*waits)):
                    return 130
                await self.router.start()
                if not await self._unless_stopping(self._wait_ready(session, self.router_url, self.router, "/ready")):
                    return 130
            except StartupFailed as exc:
                print(f"dpserve: {exc}", file=sys.stderr, flush=True)
                return 1
            self._started = True
            print(self.table(), flush=True)
            print(f"dpserve: router ready at {self.router_url}/v1 (Ctrl-C stops everything)", flush=True)
            watchers = [
                asyncio.create_task(proc.supervise(self.stopping, self._on_exit, self._readiness_reporter(session)))
                for proc in (*self.replicas, self.router)
            ]
            await self.stopping.wait()
            for watcher in watchers:
                watcher.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
        return 0

    def _on_exit(self, proc: ManagedProcess, exit_code: int | None, backoff: float) -> None:
        print(f"dpserve: {proc.name} exited (code {exit_code}); restarting in {backoff:.0f}s", flush=True)
        print(self.table(), flush=True)

    def _readiness_reporter(self, session: aiohttp.ClientSession) -> Callable[[ManagedProcess], Awaitable[None]]:
        async def report(proc: ManagedProcess) -> None:
            url = self.router_url if proc is self.router else self.plans[self.replicas.index(proc)].url
            path = "/ready" if proc is self.router else "/v1/models"
            try:
                await self._wait_ready(session, url, proc, path)
            except StartupFailed as exc:
                print(f"dpserve: {exc}", flush=True)  # it exited again: the supervisor restarts it
                return
            print(f"dpserve: {proc.name} is back (restart #{proc.restarts})", flush=True)
            print(self.table(), flush=True)

        return report

    async def _unless_stopping(self, work: Awaitable[object]) -> bool:
        """Run `work`; False when a stop signal came first."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            task.result()
            return True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, StartupFailed):
            await task
        return False

    async def _wait_ready(
        self, session: aiohttp.ClientSession, url: str, proc: ManagedProcess, path: str = "/v1/models"
    ) -> None:
        deadline = time.monotonic() + self.settings.replica_start_timeout_s
        timeout = aiohttp.ClientTimeout(total=5)
        while time.monotonic() < deadline:
            if proc.process is None or proc.process.returncode is not None:
                code = proc.process.returncode if proc.process else None
                tail = log_tail(proc.log_path)
                detail = f":\n{tail}" if tail else ""
                raise StartupFailed(f"{proc.name} exited during start-up (code {code}){detail}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url + path, timeout=timeout) as resp:
                    if resp.status == 200:
                        proc.state = "ready"
                        return
            await asyncio.sleep(1.0)
        raise StartupFailed(f"{proc.name} was not ready after {self.settings.replica_start_timeout_s:.0f}s")

    async def shutdown(self) -> None:
        # The router first, so in-flight streams finish while the replicas still serve them; it gets
        # its own grace period and a margin.
        await self.router.stop(self.settings.router.shutdown_grace_s + 5)
        await asyncio.gather(*(proc.stop(STOP_GRACE_S) for proc in self.replicas))
        if self._started:
            print("dpserve: stopped every replica and the router", flush=True)


def busy_ports(ports: Iterable[int], host: str = "127.0.0.1") -> list[int]:
    """Ports something already listens on: found in milliseconds, rather than after a replica's minute-long start."""
    busy = []
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


def _resolve_model(settings: UpSettings) -> tuple[str, str | None]:
    if settings.model:
        return settings.model, settings.served_model_name
    from dpserve.tiny_model import TINY_MODEL_NAME, ensure_tiny_model

    print(f"dpserve: no --model given; using the built-in tiny model (cache: {settings.cache_dir})", flush=True)
    path = ensure_tiny_model(settings.cache_dir)
    return str(path), settings.served_model_name or TINY_MODEL_NAME


def _plan(settings: UpSettings) -> tuple[list[ReplicaPlan], str | None]:
    """The replicas to start, and the model directory whose tokenizer the router can load (if any)."""
    if settings.sim_replicas:
        from dpserve.tiny_model import TINY_MODEL_NAME

        return plan_sims(settings, settings.served_model_name or settings.model or TINY_MODEL_NAME), None
    gpus, why_none = count_nvidia_gpus()
    if why_none:
        # The router logs the reason (`no NVIDIA GPU found: ...`) once, as its GPU section's state.
        print("dpserve: no GPU, so vLLM runs on the CPU", flush=True)
    model, served_name = _resolve_model(settings)
    # Measured (benchmarks/README.md): the router's own tokenizer costs far less than a
    # round trip to a replica's /tokenize, so use it whenever the model's files are here.
    tokenizer = model if (Path(model) / "tokenizer.json").is_file() else None
    return plan_replicas(settings, model, served_name, gpus, sorted(os.sched_getaffinity(0))), tokenizer


def run_launcher(settings: UpSettings) -> int:
    logging.basicConfig(
        level=settings.router.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        # The router's own refusals, before minutes of starting replicas for nothing.
        check_bind(settings.router.host, load_keys(settings.router), settings.router.insecure)
    except ValueError as exc:
        print(f"dpserve: {exc}", file=sys.stderr)
        return 2
    try:
        plans, tokenizer = _plan(settings)
    except PlanError as exc:
        print(f"dpserve: {exc}", file=sys.stderr)
        return 2
    ports = [settings.router.port, *(p.port for p in plans), *(p.kv_events_port for p in plans)]
    taken = busy_ports(ports)
    if taken:
        print(
            f"dpserve: port(s) {', '.join(map(str, taken))} already in use; "
            "pick others with --port, --base-port or --kv-events-base-port",
            file=sys.stderr,
        )
        return 2
    run_dir = settings.run_dir or Path(tempfile.mkdtemp(prefix="dpserve-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(Launcher(settings, plans, run_dir, tokenizer).run())
