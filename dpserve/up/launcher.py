"""`dpserve up`: start the replicas, wait until they serve, start the router, keep them all alive."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

import aiohttp

from dpserve.config import UpSettings
from dpserve.gpu.topology import GpuTopology, read_topology
from dpserve.replicas.access import ReplicaAccess
from dpserve.router.flow.access import check_bind, load_keys
from dpserve.text_table import format_table
from dpserve.up.elastic import ElasticFleet, Slot
from dpserve.up.engine_dp import engine_core_sets, pin_engine_processes, plan_dp_server, plan_dp_sim
from dpserve.up.plan import (
    PlanError,
    ReplicaPlan,
    RouterPlan,
    events_known,
    plan_replicas,
    plan_routers,
    plan_sims,
    router_env,
    with_replica_key,
)
from dpserve.up.process import ManagedProcess, log_tail

log = logging.getLogger("dpserve.up")
STOP_GRACE_S = 30.0
DEFAULT_COLD_START_WAIT_S = 120.0
"""--min-replicas 0 without --cold-start-wait: how long the first request waits for a replica to start."""
ELASTIC_READY_POLL_S = 0.1
"""A replica started for waiting requests is looked at this often: it serves within this of being ready."""


class StartupFailed(RuntimeError):
    pass


TABLE_HEADER = ("REPLICA", "URL", "DEVICE", "STATE", "PID", "LOG")


class Launcher:
    def __init__(
        self, settings: UpSettings, plans: list[ReplicaPlan], routers: list[RouterPlan], run_dir: Path
    ) -> None:
        self.settings = settings
        self.plans = plans
        self.router_plans = routers
        self.run_dir = run_dir
        self.replicas = [
            ManagedProcess(plan.id, plan.argv, plan.env, run_dir / f"{plan.id}.log", plan.cpus) for plan in plans
        ]
        self.routers = [ManagedProcess(plan.name, plan.argv, router_env(settings.router), None) for plan in routers]
        # The replicas' /v1/models, which readiness reads, is behind their key when they have one.
        self._replica_headers = ReplicaAccess(settings.router.replica_api_key).headers
        self.stopping = asyncio.Event()
        self._started = False
        self.initial = settings.fewest_replicas if settings.elastic else len(plans)
        """Replicas started at once: all of them, or (elastic) the fewest kept running."""
        self.elastic: ElasticFleet | None = None

    @property
    def policy(self) -> str:
        return self.settings.router.policy or ("kv_aware" if events_known(self.settings) else "least_loaded")

    def _url_of(self, proc: ManagedProcess) -> tuple[str, str]:
        """Where a child answers once it serves: a router's /ready, a replica's /v1/models."""
        if proc in self.routers:
            return self.router_plans[self.routers.index(proc)].url, "/ready"
        return self.plans[self.replicas.index(proc)].url, "/v1/models"

    def table(self) -> str:
        rows = [
            (plan.id, plan.url, plan.device, proc.state, str(proc.pid or "-"), str(proc.log_path))
            for plan, proc in zip(self.plans, self.replicas, strict=True)
        ]
        rows += [
            (plan.name, plan.url, f"policy={self.policy}", proc.state, str(proc.pid or "-"), "(this terminal)")
            for plan, proc in zip(self.router_plans, self.routers, strict=True)
        ]
        return format_table(TABLE_HEADER, rows)

    def ready_message(self) -> str:
        urls = ", ".join(f"{plan.url}/v1" for plan in self.router_plans)
        what = "router" if len(self.router_plans) == 1 else f"{len(self.router_plans)} routers"
        return f"dpserve: {what} ready at {urls} (Ctrl-C stops everything)"

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        try:
            return await self._run()
        finally:
            await self.shutdown()

    async def _run(self) -> int:
        engines = sum(plan.engines for plan in self.plans)
        of = f" ({engines} data-parallel engines)" if engines > len(self.plans) else ""
        first = self.replicas[: self.initial]
        elastic = f" of at most {len(self.plans)}, as the load needs" if self.settings.elastic else ""
        print(f"dpserve: starting {len(first)} replica(s){elastic}{of}; logs in {self.run_dir}", flush=True)
        for proc in first:
            await proc.start()
        async with aiohttp.ClientSession() as session:
            try:
                waits = [self._wait_ready(session, *self._url_of(proc), proc) for proc in first]
                if not await self._unless_stopping(asyncio.gather(*waits)):
                    return 130
                for router in self.routers:
                    await router.start()
                # All at once: each may wait a moment for its peers' snapshot before it says it is ready.
                waits = [self._wait_ready(session, *self._url_of(router), router) for router in self.routers]
                if not await self._unless_stopping(asyncio.gather(*waits)):
                    return 130
            except StartupFailed as exc:
                print(f"dpserve: {exc}", file=sys.stderr, flush=True)
                return 1
            self._started = True
            print(self.table(), flush=True)
            print(self.ready_message(), flush=True)
            watchers = [self._supervise(session, proc) for proc in (*first, *self.routers)]
            if self.settings.elastic:
                self.elastic = self._elastic_fleet(session)
                watchers.append(asyncio.create_task(self.elastic.run(self.stopping)))
            await self.stopping.wait()
            for watcher in watchers:
                watcher.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
        return 0

    def _supervise(self, session: aiohttp.ClientSession, proc: ManagedProcess) -> asyncio.Task[None]:
        """Restarts `proc` whenever it exits, until dpserve stops (or, elastic, until the replica is let go)."""
        return asyncio.create_task(proc.supervise(self.stopping, self._on_exit, self._readiness_reporter(session)))

    def _elastic_fleet(self, session: aiohttp.ClientSession) -> ElasticFleet:
        slots = [Slot(plan, proc) for plan, proc in zip(self.plans, self.replicas, strict=True)]
        for slot in slots[: self.initial]:
            slot.state = "ready"
        keys = load_keys(self.settings.router)
        admin = {"Authorization": f"Bearer {keys.admins[0].decode()}"} if keys.admins else {}

        async def wait_ready(proc: ManagedProcess) -> None:
            await self._wait_ready(session, *self._url_of(proc), proc, poll_s=ELASTIC_READY_POLL_S)

        return ElasticFleet(
            slots,
            [plan.url for plan in self.router_plans],
            admin,
            self._replica_headers,
            (self.settings.fewest_replicas, len(self.plans)),
            wait_ready,
            lambda proc: self._supervise(session, proc),
            events_known(self.settings),
            lambda line: print(line, flush=True),
        )

    def _on_exit(self, proc: ManagedProcess, exit_code: int | None, backoff: float) -> None:
        print(f"dpserve: {proc.name} exited (code {exit_code}); restarting in {backoff:.0f}s", flush=True)
        print(self.table(), flush=True)

    def _readiness_reporter(self, session: aiohttp.ClientSession) -> Callable[[ManagedProcess], Awaitable[None]]:
        async def report(proc: ManagedProcess) -> None:
            try:
                await self._wait_ready(session, *self._url_of(proc), proc)
            except StartupFailed as exc:
                print(f"dpserve: {exc}", flush=True)  # it exited again: the supervisor restarts it
                return
            print(f"dpserve: {proc.name} is back (restart #{proc.restarts})", flush=True)
            if self.elastic is not None and proc in self.routers:
                await self.elastic.router_back(self.router_plans[self.routers.index(proc)].url)
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
        self, session: aiohttp.ClientSession, url: str, path: str, proc: ManagedProcess, poll_s: float = 1.0
    ) -> None:
        deadline = time.monotonic() + self.settings.replica_start_timeout_s
        timeout = aiohttp.ClientTimeout(total=5)
        while time.monotonic() < deadline:
            if proc.process is None or proc.process.returncode is not None:
                code = proc.process.returncode if proc.process else None
                tail = log_tail(proc.log_path)
                detail = f":\n{tail}" if tail else ""
                raise StartupFailed(f"{proc.name} exited during start-up (code {code}){detail}")
            headers = self._replica_headers if proc in self.replicas else None
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url + path, timeout=timeout, headers=headers) as resp:
                    if resp.status == 200:
                        proc.state = "ready"
                        self._pin_engines(proc)
                        return
            await asyncio.sleep(poll_s)
        raise StartupFailed(f"{proc.name} was not ready after {self.settings.replica_start_timeout_s:.0f}s")

    def _pin_engines(self, proc: ManagedProcess) -> None:
        """A CPU data-parallel server's engine processes onto their engines' cores (after every start)."""
        if proc not in self.replicas or proc.process is None:
            return
        core_sets = engine_core_sets(self.plans[self.replicas.index(proc)])
        if core_sets:
            pinned = pin_engine_processes(proc.process.pid, core_sets)
            log.info("%s: engine processes pinned to their cores: %s", proc.name, sorted(pinned.values()))

    async def shutdown(self) -> None:
        # The routers first, so in-flight streams finish while the replicas still serve them; they get
        # their own grace period and a margin.
        await asyncio.gather(*(router.stop(self.settings.router.shutdown_grace_s + 5) for router in self.routers))
        await asyncio.gather(*(proc.stop(STOP_GRACE_S) for proc in self.replicas))
        if self._started:
            routers = "the router" if len(self.routers) == 1 else "every router"
            print(f"dpserve: stopped every replica and {routers}", flush=True)


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

        served = settings.served_model_name or settings.model or TINY_MODEL_NAME
        return (plan_dp_sim(settings, served) if settings.engine_dp else plan_sims(settings, served)), None
    topology, why_none = read_topology()
    gpus = topology.count if topology else 0
    if importlib.util.find_spec("vllm") is None:
        # Said before the tiny model is built and a replica fails with a bare ModuleNotFoundError.
        extra = "gpu" if gpus else "cpu"
        raise PlanError(
            f"vLLM is not installed in this Python ({sys.executable}): install the engine with "
            f"`pip install 'dpserve[{extra}]'`, or run simulated replicas with `dpserve up --sim N`"
        )
    if why_none:
        # The router logs the reason (`no NVIDIA GPU found: ...`) once, as its GPU section's state.
        print("dpserve: no GPU, so vLLM runs on the CPU", flush=True)
    model, served_name = _resolve_model(settings)
    # Measured (docs/benchmarks/policies.md): the router's own tokenizer costs far less than a
    # round trip to a replica's /tokenize, so use it whenever the model's files are here.
    tokenizer = model if (Path(model) / "tokenizer.json").is_file() else None
    cores = sorted(os.sched_getaffinity(0))
    if settings.engine_dp:
        return plan_dp_server(settings, model, served_name, gpus, cores), tokenizer
    plans = plan_replicas(settings, model, served_name, topology or 0, cores)
    if topology and settings.tensor_parallel_size > 1:
        print(grouping_line(topology, plans), flush=True)
    return plans, tokenizer


def grouping_line(topology: GpuTopology, plans: Sequence[ReplicaPlan]) -> str:
    """How the GPUs were grouped, each group with its worst link: what to check against `nvidia-smi topo -m`."""
    groups = "; ".join(f"{plan.id} {topology.describe(plan.gpus)}" for plan in plans)
    return f"dpserve: GPUs grouped by {topology.source} topology: {groups}"


def elastic_settings(settings: UpSettings) -> UpSettings:
    """Elastic: replicas planned for --max-replicas; scaled to zero, requests wait for the first (a default
    --cold-start-wait); with keys, an admin key for the launcher to follow the signal with, new each run."""
    if settings.max_replicas is None:
        return settings
    if not settings.elastic:  # a range of one: a fixed fleet of that size
        return dataclasses.replace(settings, num_replicas=settings.max_replicas, min_replicas=None, max_replicas=None)
    if settings.engine_dp:
        raise PlanError("--min-replicas/--max-replicas start and stop whole replicas; --engine-dp runs one server")
    router = settings.router
    if settings.fewest_replicas == 0 and not router.cold_start_wait_s:
        router = dataclasses.replace(router, cold_start_wait_s=DEFAULT_COLD_START_WAIT_S)
    if load_keys(router).enabled and not load_keys(router).admins:
        router = dataclasses.replace(router, admin_keys=(secrets.token_urlsafe(24),))
    sims = settings.max_replicas if settings.sim_replicas else 0
    return dataclasses.replace(settings, router=router, num_replicas=settings.max_replicas, sim_replicas=sims)


def run_launcher(settings: UpSettings, routers: int = 1) -> int:
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
        if routers < 1:  # before a model is built for nothing
            raise PlanError("--routers must be at least 1")
        lora_dir = settings.router.lora_dir
        if lora_dir and not Path(lora_dir).expanduser().is_dir():
            raise PlanError(f"--lora-dir {lora_dir}: no such folder here (the replicas read it from this host)")
        try:
            settings = with_replica_key(settings)
        except ValueError as exc:  # its key file
            raise PlanError(str(exc)) from None
        settings = elastic_settings(settings)
        plans, tokenizer = _plan(settings)
        initial = settings.fewest_replicas if settings.elastic else len(plans)
        router_plans = plan_routers(settings, routers, plans, tokenizer, initial)
    except PlanError as exc:
        print(f"dpserve: {exc}", file=sys.stderr)
        return 2
    ports = [*(r.port for r in router_plans), *(port for p in plans for port in p.ports)]
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
    return asyncio.run(Launcher(settings, plans, router_plans, run_dir).run())
