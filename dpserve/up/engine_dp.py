"""`dpserve up --engine-dp`: vLLM's own data parallelism as the replicas' layout. One `vllm serve
--data-parallel-size N` server per host instead of N single-engine servers: its engines share one API server
(one port), each engine publishes its KV events on the endpoint's port plus its rank, and the router, told
`URL@dp=N`, routes each engine as a replica of its own (`r0:dp0`, `r0:dp1`, pinned with X-data-parallel-rank).

N is the replica count (`--replicas`, else one engine per GPU, else 2 on the CPU). On GPUs the server sees
GPUs 0..N-1 and vLLM gives engine r the r-th; on the CPU each engine is bound to its own cores, the same sets
`plan_replicas` gives N single-engine replicas (`VLLM_CPU_OMP_THREADS_BIND="0|1"`: engine r, the r-th set)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Sequence

import psutil

from dpserve.config import UpSettings
from dpserve.replicas.registry import replica_ids
from dpserve.up.plan import (
    DEFAULT_CPU_REPLICAS,
    LORA_RUNTIME_ENV,
    PlanError,
    ReplicaPlan,
    replica_key_env,
    sim_argv,
    split_cores,
    vllm_argv,
)
from dpserve.up.vllm_args import given

DP_FLAGS = ("--data-parallel-size", "--data-parallel-rpc-port", "--data-parallel-size-local")


def engine_count(settings: UpSettings, gpu_count: int) -> int:
    """Engines in the server: as many as `plan_replicas` would start replicas."""
    count = settings.num_replicas or gpu_count or DEFAULT_CPU_REPLICAS
    if gpu_count and count > gpu_count:
        raise PlanError(f"--engine-dp --replicas {count} asks for more engines than the {gpu_count} GPUs found")
    if count < 1:
        raise PlanError("--replicas must be at least 1")
    return count


def rpc_port(settings: UpSettings) -> int:
    """The server's data-parallel RPC port: the port a second single-engine replica would have had (vLLM's own
    default, 29550, would clash with any other data-parallel server on the host)."""
    return settings.base_port + 1


def _with_dp_flags(settings: UpSettings, engines: int) -> UpSettings:
    """The settings with the server's data-parallel flags before the user's own (which come last and win,
    except these: the engine count is the router's to know)."""
    if given(settings.vllm_args, *DP_FLAGS):
        raise PlanError(f"--engine-dp sets {', '.join(DP_FLAGS[:2])} itself (from --replicas): leave them out after --")
    flags = ("--data-parallel-size", str(engines), "--data-parallel-rpc-port", str(rpc_port(settings)))
    return dataclasses.replace(settings, vllm_args=(*flags, *settings.vllm_args))


def plan_dp_server(
    settings: UpSettings, model: str, served_name: str | None, gpu_count: int, cores: Sequence[int]
) -> list[ReplicaPlan]:
    """The one vLLM data-parallel server `dpserve up --engine-dp` starts on this host."""
    if settings.tensor_parallel_size > 1:
        # Engines of several ranks each would need vLLM's DP x TP core and GPU layout: not planned (yet).
        raise PlanError("--engine-dp with --tensor-parallel-size above 1 is not supported: pick one")
    engines = engine_count(settings, gpu_count)
    (rid,) = replica_ids(1)
    port, kv_port = settings.base_port, settings.kv_events_base_port
    argv = vllm_argv(_with_dp_flags(settings, engines), model, served_name, port, kv_port)
    lora_env = LORA_RUNTIME_ENV if settings.lora_enabled else {}
    key_env = replica_key_env(settings)
    extra_ports = (rpc_port(settings),) if engines > 1 else ()
    if gpu_count:
        gpus = ",".join(str(index) for index in range(engines))
        env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": gpus, **lora_env, **key_env}
        plan = ReplicaPlan(rid, port, kv_port, f"cuda:{gpus}", env, None, argv, tuple(range(engines)))
        return [dataclasses.replace(plan, engines=engines, extra_ports=extra_ports)]
    core_sets = split_cores(cores, engines)
    bind = "|".join(",".join(str(cpu) for cpu in cpus) for cpus in core_sets)
    env = {
        "CUDA_VISIBLE_DEVICES": "",
        "VLLM_CPU_KVCACHE_SPACE": str(settings.cpu_kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        **lora_env,
        **key_env,
    }
    cpus = tuple(sorted({cpu for cpus in core_sets for cpu in cpus}))
    plan = ReplicaPlan(rid, port, kv_port, f"cpu:{bind}", env, cpus, argv)
    return [dataclasses.replace(plan, engines=engines, extra_ports=extra_ports)]


def plan_dp_sim(settings: UpSettings, served_name: str) -> list[ReplicaPlan]:
    """`dpserve up --sim N --engine-dp`: one `dpserve sim --data-parallel-size N`, as vLLM's server."""
    engines = settings.sim_replicas
    if engines < 1:
        raise PlanError("--sim must be at least 1")
    (rid,) = replica_ids(1)
    port, kv_port = settings.base_port, settings.kv_events_base_port
    dp = dataclasses.replace(settings, vllm_args=("--data-parallel-size", str(engines), *settings.vllm_args))
    plan = ReplicaPlan(rid, port, kv_port, "sim", {}, None, sim_argv(dp, served_name, port, kv_port))
    return [dataclasses.replace(plan, engines=engines)]


ENGINE_PROCESS = re.compile(r"^VLLM::EngineCore_DP(\d+)\b")
"""How vLLM titles a data-parallel server's engine process (`set_process_title`)."""


def engine_core_sets(plan: ReplicaPlan) -> list[tuple[int, ...]]:
    """The cores each engine of a CPU data-parallel server is bound to (its VLLM_CPU_OMP_THREADS_BIND), by
    rank; none for a GPU server or a single engine."""
    bind = plan.env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if plan.engines < 2 or "|" not in bind:
        return []
    return [tuple(int(cpu) for cpu in part.split(",")) for part in bind.split("|")]


def pin_engine_processes(root_pid: int, core_sets: Sequence[tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Every thread of each engine process (`VLLM::EngineCore_DP<r>`) under `root_pid` onto core set r:
    vLLM binds only the engine's model worker there (VLLM_CPU_OMP_THREADS_BIND) and leaves the engine process,
    which busy-polls its worker between steps, free to run on the other engines' cores (measured: 2 engines on
    2 cores served about half the requests per second unpinned). Returns the pid pinned for each rank."""
    pinned: dict[int, tuple[int, ...]] = {}
    try:
        family = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return pinned
    for process in family:
        with contextlib.suppress(psutil.Error, OSError):
            match = ENGINE_PROCESS.match(" ".join(process.cmdline()).strip())
            if match is None or int(match.group(1)) >= len(core_sets):
                continue
            cores = core_sets[int(match.group(1))]
            for thread in process.threads():
                os.sched_setaffinity(thread.id, cores)
            pinned[process.pid] = cores
    return pinned
