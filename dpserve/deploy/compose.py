"""The Docker Compose stack for one multi-GPU host, for any number of GPUs.

One vLLM service per GPU (`vllm-0` ... `vllm-{N-1}`), each reserving its own GPU (with `--tensor-parallel-size
K`, one per K GPUs, consecutive indices); the router, built
from `router/Dockerfile` and told of each replica by service name (with `--routers N`, also `router-2` ...
`router-N`, each told of the others with `--peer`); the host's GPU agent (`dpserve
agent`, same image), which reads every GPU through NVML and which the router polls; the `monitoring` profile
(Prometheus, Grafana) and the `loadtest` profile (Locust master and workers). What a user tunes (model,
images, ports) is read from `.env` through Compose's `${VAR:-default}`; the GPU count is the number of
services, so it is chosen when the file is written.

The scaled variant (compose.scaled.yaml) has one replica service, `vllm`, run as REPLICAS containers
(`docker compose up --scale vllm=N`), each asking the runtime for one GPU; the router finds them through
Docker's embedded DNS (`--discover dns:vllm:8000`), which answers with one address per container.

The replicas are on a network of their own, `replicas` (internal: no way out, and no way in but from the
containers on it), which only the routers and Prometheus join besides them; the GPU stack's replicas also
have `replica-egress`, theirs alone, to download weights (the overrides drop it: their model is built in).
vLLM requires REPLICA_API_KEY on /v1 (as VLLM_API_KEY: vLLM has no key-file flag, so it stays in the replicas'
environment), and the routers send it, read from a file.

The routers' keys are Compose secrets, files under `.secrets/` (tools/compose-secrets.sh writes them) mounted at
/run/secrets/NAME: the replicas' key (`--replica-api-key-file`), and client and admin keys (`--api-key-file`,
`--admin-key-file`, through DPSERVE_API_KEY_FILE and DPSERVE_ADMIN_KEY_FILE, which the script sets when those
files hold keys). The router reads them again when they change: keys rotate without a restart. A file-sourced
secret is a bind mount of the host's file (Compose takes no uid, gid or mode for it outside Swarm): the folder
is the host's guard (mode 700), the files are readable by the containers' users (nobody); rewrite them in place
(a new file under the old name is another inode, which the container never sees).

With `--tls` (compose.tls.yaml; tools/compose-tls.sh makes a CA and the certificates into `.secrets/tls/`),
every hop that carries requests or keys is HTTPS, verified against that CA: clients to the routers, the routers
to vLLM (its own `--ssl-certfile`, refreshed when the files change), router to router, the healthchecks and
Prometheus' scrapes. Left in the clear, as in kube: the KV-event streams (ZMQ has no TLS; only the routers reach
them), the GPU agent's readings, Prometheus' and Grafana's own pages.

Override files lay another engine over either: `cpu` (vllm-cpu and the tiny model, built from
replicas/Dockerfile.cpu) and `sim` (`dpserve sim`, from the router's image: the whole container stack
in seconds, for tests). Neither starts the GPU agent: it is left in profile `gpu` (`docker compose run`
still reaches it), and the routers ask no agent.

Stopping finishes answers: Compose stops a service's dependents first, so on `docker compose down` the routers
(which depend on the replicas) drain their requests in flight while the replicas keep serving, then the
replicas drain theirs (vLLM's --shutdown-timeout), each within a stop_grace_period longer than its drain.
Every service has resource limits and reservations, drops every capability and cannot gain one.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpserve.config import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    RouterSettings,
    check_lora_engine,
    check_tensor_parallel_size,
    lora_adapters,
)
from dpserve.deploy.yaml_text import Reset, dump
from dpserve.replicas.registry import replica_ids
from dpserve.up.plan import (
    LORA_RUNTIME_ENV,
    VLLM_SERVER_MODULE,
    RouterTarget,
    router_flags,
    told_max_num_seqs,
    vllm_engine_flags,
)
from dpserve.up.vllm_args import flag_name, listed
from dpserve.version import package_version

DEFAULT_GPUS = 2
DEFAULT_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
# The vLLM release whose flags and KV-event format the tests here run against (vllm-cpu 0.32.0).
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"

REPLICA_PORT = 8000
KV_EVENTS_PORT = 5557
ROUTER_PORT = 8000
ROUTER_SERVICE = "router"
ROUTER_DATA_VOLUME = "router-data"
ROUTER_DATA_DIR = "/var/lib/dpserve"
"""The router image's XDG_DATA_HOME (router/Dockerfile): where its batch store is kept."""
ROUTER_DOCKERFILE = "router/Dockerfile"
ROUTER_IMAGE = "dpserve-router"
ROUTER_ENTRYPOINT = ("dpserve", "router")
AGENT_SERVICE = "gpu-agent"
AGENT_PORT = 9400
"""router/Dockerfile's ENTRYPOINT: the console script, then the compose file's `command` (its flags)."""
CPU_REPLICA_DOCKERFILE = "replicas/Dockerfile.cpu"
CPU_REPLICA_IMAGE = "dpserve-vllm-cpu"
CPU_MODEL_DIR = "/models/tiny"
CPU_SERVED_NAME = "dpserve-tiny"
CPU_MAX_MODEL_LEN = 4096
SCALED_SERVICE = "vllm"
DISCOVERY_INTERVAL_S = 2
"""How often the scaled stack's router asks Docker's DNS which replicas exist (compose.scaled.yaml)."""
OVERLAYS = ("cpu", "sim")
HF_CACHE_DIR = "/root/.cache/huggingface"
GRAFANA_DASHBOARDS_DIR = "/etc/dpserve/dashboards"
LOADTESTS_DIR = "/mnt/loadtests"
ADAPTERS_DIR = "/adapters"
"""Where the LoRA adapters' folder is mounted, read-only, in every replica and router container (and pod)."""

# Published ports bind to loopback unless .env says otherwise: the router has no API key by default.
# Inside the stack's network it must listen on 0.0.0.0, hence its --insecure; keys, once given in
# API_KEYS, are enforced all the same.
PUBLISH_ADDRESS = "${PUBLISH_ADDRESS:-127.0.0.1}"
SECRET_VARIABLES = (
    "HF_TOKEN",
    "API_KEYS",
    "ADMIN_KEYS",
    "REPLICA_API_KEY",
    "GRAFANA_ADMIN_PASSWORD",
    "API_KEY_FILE",
    "ADMIN_KEY_FILE",
)
"""Passed through from the shell, never written into .env. `make compose-up` generates REPLICA_API_KEY and
GRAFANA_ADMIN_PASSWORD into the git-ignored SECRETS_FILE where the shell has none, writes API_KEYS and
ADMIN_KEYS into the routers' key files, and sets the last two (KEY_FILE_VARIABLES) where those files hold keys."""
SECRETS_FILE = ".env.secrets"
SECRETS_DIR = ".secrets"
"""Where tools/compose-secrets.sh and tools/compose-tls.sh write the secrets' files (git-ignored, mode 700)."""
SECRETS_MOUNT = "/run/secrets"
REPLICA_KEY_SECRET = "replica-api-key"
API_KEYS_SECRET = "api-keys"
ADMIN_KEYS_SECRET = "admin-keys"
KEY_SECRETS = (REPLICA_KEY_SECRET, API_KEYS_SECRET, ADMIN_KEYS_SECRET)
"""The routers' keys, one a line ([NAME:]KEY for client keys), each a file `.secrets/NAME`."""
KEY_FILE_VARIABLES = {"API_KEY_FILE": API_KEYS_SECRET, "ADMIN_KEY_FILE": ADMIN_KEYS_SECRET}
"""Set by tools/compose-secrets.sh to /run/secrets/NAME when that file holds a key: a router with an empty key
file would refuse to start, and keys are turned on or off by a restart, never by a file."""
TLS_DIR = "tls"
CA_SECRET = "ca.crt"
ROUTER_CERT, ROUTER_KEY = "router.crt", "router.key"
VLLM_CERT, VLLM_KEY = "vllm.crt", "vllm.key"
TLS_SECRETS = (CA_SECRET, ROUTER_CERT, ROUTER_KEY, VLLM_CERT, VLLM_KEY)
"""tools/compose-tls.sh's files in `.secrets/tls/` (its CA's key stays there, never mounted)."""
REPLICA_NETWORK = "replicas"
EGRESS_NETWORK = "replica-egress"
AGENT_CAPABILITIES = ("SYS_PTRACE", "DAC_READ_SEARCH")
"""The GPU agent's only capabilities (Kubernetes' agent has the same; `kube.agent_security_context` says why)."""
HARDENED = {"cap_drop": ["ALL"], "security_opt": ["no-new-privileges:true"]}
"""No capability, and none to be gained through a setuid binary: every container here but the agent's."""
AGENT_PROFILE = "gpu"
"""Where the overrides (no GPU) leave the agent: defined, never started by `up`, still there for `run`."""

ROUTER_DRAIN_S = int(RouterSettings().shutdown_grace_s)
"""The router's drain on SIGTERM (--shutdown-grace-s, left at its default): requests in flight finish."""
REPLICA_DRAIN_S = ROUTER_DRAIN_S
"""vLLM's --shutdown-timeout: a replica stopped on its own (`docker compose stop vllm-0`, `restart`) lets what
it runs finish as long as a router would wait for it; 0, vLLM's default, aborts every request at once."""
ROUTER_STOP_S = ROUTER_DRAIN_S + 15
REPLICA_STOP_S = REPLICA_DRAIN_S + 30
"""Docker kills after the grace period (10 s unless set): the drain, then vLLM's engine teardown (about 10 s
on 2 cores: its workers get 5 s, then SIGTERM and 5 s more)."""
OTHER_STOP_S = ROUTER_STOP_S
"""The agent, Prometheus, Grafana and Locust exit on SIGTERM; none is cut short while the routers drain."""
REPLICA_SHM = "2gb"
"""/dev/shm of a vLLM container, through which PyTorch's processes share tensors (kube's dshm sizeLimit)."""
DEFAULT_REPLICA_MEMORY_GIB = 32
"""Host memory per GPU of a vLLM replica (limit and reservation; REPLICA_MEMORY in .env for all of them):
weights pass through it while loading, and CPU swap space lives there."""
CPU_REPLICA_MEMORY = "4g"
"""A vllm-cpu replica of the tiny model: 2.3 GiB measured with its 1 GiB KV cache (CPU_KV_CACHE_GIB)."""
REPLICA_CPUS_PER_GPU = 4
"""CPU reserved per GPU of a replica (its API server, engine core and one worker per rank), as kube requests."""
ROUTER_CPUS = 1
ROUTER_MEMORY_GIB = (1, 3)
"""A router process's reservation and limit (its KV index is up to about 1 GB at its default bound), times
its workers: kube's figures. No CPU limit: a throttled router adds latency to every request it relays."""
NONROOT = "65534:65534"
"""nobody: the user of the router's image, and of vllm-cpu here (the GPU image's caches are under /root)."""
VLLM_FLAGS_OF_COMPOSE = {
    "--model": "dpserve compose --model (or MODEL in .env)",
    "--host": "the stack (the routers reach port 8000)",
    "--port": "the stack (the routers reach port 8000)",
    "--served-model-name": "the stack (the routers and load tests name the model)",
    "--max-model-len": "MAX_MODEL_LEN in .env",
    "--gpu-memory-utilization": "GPU_MEMORY_UTILIZATION in .env",
    "--tensor-parallel-size": "dpserve compose --tensor-parallel-size",
    "-tp": "dpserve compose --tensor-parallel-size",
    "--api-key": "REPLICA_API_KEY (the routers send it)",
    "--kv-events-config": "the stack (the routers subscribe to tcp://REPLICA:5557)",
    "--shutdown-timeout": "the stack (its stop_grace_period is set above it)",
    "--enable-lora": "dpserve compose --enable-lora",
    "--max-loras": "dpserve compose --max-loras (or MAX_LORAS in .env)",
    "--max-lora-rank": "dpserve compose --max-lora-rank (or MAX_LORA_RANK in .env)",
}
"""vLLM flags the stack writes itself, and where to set them instead of after `--`."""
VLLM_TLS_FLAGS = {
    flag: "dpserve compose --tls (tools/compose-tls.sh makes the files)"
    for flag in ("--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certs", "--enable-ssl-refresh")
}
"""With --tls, vLLM's TLS flags are the stack's too."""


def secret_path(name: str) -> str:
    """Where a container reads the secret `name`."""
    return f"{SECRETS_MOUNT}/{name}"


def secret_source(name: str) -> str:
    """The host's file of the secret `name`, relative to the compose file."""
    folder = f"{SECRETS_DIR}/{TLS_DIR}" if name in TLS_SECRETS else SECRETS_DIR
    return f"./{folder}/{name}"


def required(name: str) -> str:
    """A secret Compose refuses to start without (`make compose-up` generates it)."""
    return f"${{{name}:?{name} is not set: make compose-up generates it into {SECRETS_FILE}, or export it}}"


REPLICA_KEY = required("REPLICA_API_KEY")


def router_image() -> str:
    """router/Dockerfile's image, tagged with this package's version (compose and kube alike)."""
    return f"{ROUTER_IMAGE}:{package_version()}"


def cpu_replica_image() -> str:
    """replicas/Dockerfile.cpu's image, tagged with this package's version as the router's is."""
    return f"{CPU_REPLICA_IMAGE}:{package_version()}"


def var(name: str, default: object) -> str:
    """A value Compose reads from the environment or `.env`, with the default written here."""
    return f"${{{name}:-{default}}}"


def check_vllm_args(args: tuple[str, ...], tls: bool = False) -> None:
    """Flags after `--` go to every vLLM replica, but not those the stack writes itself: a ValueError naming
    the flag and where it is set."""
    written = {**VLLM_FLAGS_OF_COMPOSE, **(VLLM_TLS_FLAGS if tls else {})}
    for arg in args:
        if (own := listed(flag_name(arg), written)) is not None:
            raise ValueError(f"-- {arg}: set by {written[own]}, not after `--`")


@dataclass(frozen=True)
class ComposeOptions:
    gpus: int = DEFAULT_GPUS
    model: str = DEFAULT_MODEL
    scaled: bool = False
    """One replica service scaled to `gpus` containers, found by DNS, instead of one service per GPU."""
    routers: int = 1
    """Router services, each a peer of the others: they share in-flight counts and routes."""
    router_workers: int = 1
    """Router processes in each router container (`--workers`), behind its one port."""
    lora: tuple[str, ...] = ()
    """`NAME=PATH` adapters for the routers to load, PATH as the replicas' containers see it."""
    lora_dir: str | None = None
    """The host's folder of adapters, mounted read-only at ADAPTERS_DIR in every replica and router."""
    lora_affinity: bool = True
    enable_lora: bool = False
    """LoRA in the replicas without adapters given here (implied by `lora` and `lora_dir`)."""
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    otlp_traces_endpoint: str | None = None
    """Where the routers and the vLLM replicas export traces (OTLP): vLLM's spans nest under the router's."""
    tensor_parallel_size: int = 1
    """GPUs per replica (vLLM's flag): `gpus` / K replica services, service i reserving GPUs K*i .. K*i+K-1."""
    vllm_args: tuple[str, ...] = ()
    """vLLM's own flags, after `--`: added to every vLLM replica's command (GPU and CPU alike)."""
    replica_memory_gib: int = DEFAULT_REPLICA_MEMORY_GIB
    """Host memory per GPU of a vLLM replica: its limit and reservation, times its GPUs (REPLICA_MEMORY wins)."""
    tls: bool = False
    """HTTPS on every hop that carries requests or keys, verified against the CA of tools/compose-tls.sh."""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"--gpus {self.gpus}: at least one GPU")
        check_tensor_parallel_size(self.tensor_parallel_size)
        if self.gpus % self.tensor_parallel_size:
            raise ValueError(
                f"--tensor-parallel-size {self.tensor_parallel_size} does not divide --gpus {self.gpus}: "
                "each replica needs exactly that many GPUs"
            )
        if not self.model.strip():
            raise ValueError("--model must name a model")
        if self.routers < 1:
            raise ValueError(f"--routers {self.routers}: at least one router")
        if self.router_workers < 1:
            raise ValueError(f"--router-workers {self.router_workers}: at least one worker")
        lora_adapters(self.lora)
        if self.lora_dir is not None and not self.lora_dir.strip():
            raise ValueError("--lora-dir must name a folder")
        check_lora_engine(self.max_loras, self.max_lora_rank)
        check_vllm_args(self.vllm_args, self.tls)
        if self.tls and self.scaled:
            raise ValueError(
                "--tls with --scaled: the router finds the scaled replicas by address, which no certificate "
                "names; use one service per GPU (without --scaled)"
            )
        if self.replica_memory_gib < 1:
            raise ValueError(f"replica memory {self.replica_memory_gib} GiB: at least 1 GiB per GPU")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora or self.lora_dir)

    @property
    def replicas(self) -> int:
        """vLLM replicas: one per `tensor_parallel_size` GPUs."""
        return self.gpus // self.tensor_parallel_size

    def replica_gpus(self, index: int) -> list[int]:
        """Replica `index`'s GPUs: consecutive host indices (no NVML where the file is written; see
        docs/deploy.md for boards whose NVLink pairs are not index pairs)."""
        size = self.tensor_parallel_size
        return list(range(index * size, (index + 1) * size))

    @property
    def replica_services(self) -> list[str]:
        if self.scaled:
            return [SCALED_SERVICE]
        return [replica_service(index) for index in range(self.replicas)]

    @property
    def router_services(self) -> list[str]:
        return [router_service(index) for index in range(self.routers)]

    def flags(self) -> str:
        """The command line that writes this stack, as the file's header says (defaults left out)."""
        flags = f"--gpus {self.gpus}" + (" --scaled" if self.scaled else "")
        if self.tensor_parallel_size != 1:
            flags += f" --tensor-parallel-size {self.tensor_parallel_size}"
        if self.routers != 1:
            flags += f" --routers {self.routers}"
        if self.router_workers != 1:
            flags += f" --router-workers {self.router_workers}"
        for spec in self.lora:
            flags += f" --lora {shlex.quote(spec)}"
        if self.lora_dir:
            flags += f" --lora-dir {shlex.quote(self.lora_dir)}"
        if not self.lora_affinity:
            flags += " --lora-affinity off"
        if self.enable_lora and not (self.lora or self.lora_dir):
            flags += " --enable-lora"
        if self.max_loras != DEFAULT_MAX_LORAS:
            flags += f" --max-loras {self.max_loras}"
        if self.max_lora_rank != DEFAULT_MAX_LORA_RANK:
            flags += f" --max-lora-rank {self.max_lora_rank}"
        if self.otlp_traces_endpoint:
            flags += f" --otlp-traces-endpoint {shlex.quote(self.otlp_traces_endpoint)}"
        return flags + (" --tls" if self.tls else "")

    def vllm_flags(self) -> str:
        """` -- FLAGS`, the end of the command line that writes this stack, where vLLM flags were given."""
        return f" -- {shlex.join(self.vllm_args)}" if self.vllm_args else ""

    @property
    def replica_memory(self) -> str:
        """A vLLM replica's host memory (limit and reservation), REPLICA_MEMORY in .env over the option."""
        return var("REPLICA_MEMORY", f"{self.replica_memory_gib * self.tensor_parallel_size}g")

    def file_name(self, overlay: str | None = None) -> str:
        stem = "compose" + (".scaled" if self.scaled else "") + (".tls" if self.tls else "")
        return stem + (f".{overlay}" if overlay else "") + ".yaml"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def tls_names(self) -> list[str]:
        """The services tools/compose-tls.sh makes certificates for: the routers', then the replicas'."""
        return [*self.router_services, *self.replica_services]


def replica_service(index: int) -> str:
    return f"vllm-{index}"


def router_service(index: int) -> str:
    """`router`, as with one router (what load tests, Prometheus and the Makefile know), then `router-2` ..."""
    return ROUTER_SERVICE if index == 0 else f"{ROUTER_SERVICE}-{index + 1}"


def router_host_port(index: int) -> str:
    """The host port router `index` is published on: ROUTER_PORT for the first, as with one router; the
    others have their own variable, defaulting to the next ports (Compose cannot add to a variable)."""
    if index == 0:
        return var("ROUTER_PORT", ROUTER_PORT)
    return var(f"ROUTER_{index + 1}_PORT", ROUTER_PORT + index)


def _http_health(port: int, path: str, start_period: str, tls: bool = False) -> dict[str, Any]:
    # Python is in every image here (vLLM's, the router's, the CPU replica's); curl is not promised.
    # No `start_interval`: Compose refuses it before Docker Engine 25, and a 5 s interval costs little.
    probe = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=5)"
    if tls:
        # The certificate checked as any client checks it (it names 127.0.0.1 too), against the stack's CA.
        context = f"ssl.create_default_context(cafile='{secret_path(CA_SECRET)}')"
        probe = (
            f"import ssl, urllib.request; "
            f"urllib.request.urlopen('https://127.0.0.1:{port}{path}', timeout=5, context={context})"
        )
    return {
        "test": ["CMD", "python3", "-c", probe],
        "interval": "5s",
        "timeout": "10s",
        "retries": 3,
        "start_period": start_period,
    }


def _resources(cpus: str | None, memory: str, limit_cpus: str | None = None, limit_memory: str = "") -> dict[str, Any]:
    """`deploy.resources`: CPU and memory reserved, memory capped (the reservation unless `limit_memory`), CPU
    capped only where `limit_cpus` (never a router's or a replica's: throttling stalls what they serve)."""
    reservations = {"memory": memory, **({"cpus": cpus} if cpus else {})}
    limits = {"memory": limit_memory or memory, **({"cpus": limit_cpus} if limit_cpus else {})}
    return {"resources": {"limits": limits, "reservations": reservations}}


def _with_gpus(deploy: dict[str, Any], **device: Any) -> dict[str, Any]:
    """`deploy` with a device reservation of NVIDIA GPUs added."""
    resources = deploy["resources"]
    reservations = {**resources["reservations"], "devices": [{"driver": "nvidia", **device}]}
    return {**deploy, "resources": {**resources, "reservations": reservations}}


def _stop(seconds: int) -> dict[str, Any]:
    return {"stop_grace_period": f"{seconds}s"}


def _build(dockerfile: str, **args: str) -> dict[str, Any]:
    # BASE_IMAGE: the upstream Python image unless the shell says otherwise (`make compose-up` does,
    # where Docker Hub is out of reach).
    return {
        "context": ".",
        "dockerfile": dockerfile,
        "args": {"BASE_IMAGE": var("BASE_IMAGE", "python:3.11-slim"), **args},
    }


def _engine(options: ComposeOptions) -> dict[str, Any]:
    """vllm_engine_flags' LoRA arguments (the limits from .env, MAX_LORAS and MAX_LORA_RANK, as MAX_MODEL_LEN)
    and the routers' tracing endpoint."""
    return {
        "otlp_traces_endpoint": options.otlp_traces_endpoint,
        "enable_lora": options.lora_enabled,
        "max_loras": var("MAX_LORAS", options.max_loras),
        "max_lora_rank": var("MAX_LORA_RANK", options.max_lora_rank),
        "tensor_parallel_size": options.tensor_parallel_size,
    }


def _adapters_volume(options: ComposeOptions) -> list[dict[str, Any]]:
    """The host's adapter folder, read-only at ADAPTERS_DIR (LORA_DIR in .env wins, as MODEL does). Long
    syntax: a folder that is not there is an error, not an empty folder made on the host."""
    if not options.lora_dir:
        return []
    source = var("LORA_DIR", options.lora_dir)
    return [{"type": "bind", "source": source, "target": ADAPTERS_DIR, "read_only": True}]


def _secrets(options: ComposeOptions, *names: str) -> dict[str, Any]:
    """A service's `secrets`: these, and the CA where --tls (healthchecks and clients verify against it)."""
    tls = [CA_SECRET] if options.tls else []
    return {"secrets": [*names, *tls]} if names or tls else {}


def secrets_document(options: ComposeOptions) -> dict[str, Any]:
    """The top-level `secrets`: each a host file (a bind mount at /run/secrets/NAME)."""
    names = [*KEY_SECRETS, *(TLS_SECRETS if options.tls else ())]
    return {name: {"file": secret_source(name)} for name in names}


def vllm_tls_flags(options: ComposeOptions) -> list[str]:
    """vLLM's HTTPS (GPU and CPU images alike): its certificate, read again when the files change."""
    if not options.tls:
        return []
    files = ["--ssl-certfile", secret_path(VLLM_CERT), "--ssl-keyfile", secret_path(VLLM_KEY)]
    return [*files, "--enable-ssl-refresh"]


def _vllm_drain(options: ComposeOptions) -> list[str]:
    """vLLM's drain on SIGTERM, then the flags given after `--`: the end of every vLLM replica's command."""
    return ["--shutdown-timeout", str(REPLICA_DRAIN_S), *options.vllm_args]


def _vllm_service(options: ComposeOptions, index: int | None) -> dict[str, Any]:
    command = ["--model", var("MODEL", options.model), "--host", "0.0.0.0", "--port", str(REPLICA_PORT)]
    command += ["--gpu-memory-utilization", var("GPU_MEMORY_UTILIZATION", "0.90")]
    command += vllm_tls_flags(options)
    command += vllm_engine_flags(None, KV_EVENTS_PORT, var("MAX_MODEL_LEN", 8192), **_engine(options))
    command += _vllm_drain(options)
    resources = _resources(str(REPLICA_CPUS_PER_GPU * options.tensor_parallel_size), options.replica_memory)
    if index is None:
        # Scaled: each container asks for its GPUs and the runtime picks them. Docker Engine alone gives every
        # container the same first GPUs: on such a host use compose.yaml, which pins them per service.
        count = options.tensor_parallel_size
        resources = _with_gpus(resources, count=count, capabilities=["gpu"])
        deploy = {"replicas": var("REPLICAS", options.replicas), **resources}
    else:
        device_ids = [str(gpu) for gpu in options.replica_gpus(index)]
        deploy = _with_gpus(resources, device_ids=device_ids, capabilities=["gpu"])
    return {
        "image": var("VLLM_IMAGE", DEFAULT_VLLM_IMAGE),
        "entrypoint": ["python3", "-m", VLLM_SERVER_MODULE],
        "command": command,
        # With LoRA, the router loads adapters at run time (POST /v1/load_lora_adapter).
        # VLLM_API_KEY: read by vLLM as --api-key is (so `dpserve sim` reads it too), kept off the command line.
        "environment": {
            "HF_TOKEN": "${HF_TOKEN:-}",
            "VLLM_API_KEY": REPLICA_KEY,
            **(LORA_RUNTIME_ENV if options.lora_enabled else {}),
        },
        # PyTorch shares tensors between vLLM's processes through /dev/shm: a sized one of the container's own,
        # not the host's IPC namespace. vllm/vllm-openai runs as root, its one user (caches under /root, where
        # hf-cache is mounted), and writes compile caches to its root filesystem: neither `user` nor
        # `read_only` here (kube: the same); it keeps no capability and cannot gain one.
        "shm_size": REPLICA_SHM,
        "networks": [REPLICA_NETWORK, EGRESS_NETWORK],
        **HARDENED,
        "volumes": [f"hf-cache:{HF_CACHE_DIR}", *_adapters_volume(options)],
        # With --tls, its certificate and key (and the CA, for its healthcheck).
        **_secrets(options, *((VLLM_CERT, VLLM_KEY) if options.tls else ())),
        "deploy": deploy,
        # Downloading and loading weights, then compiling, can take many minutes on first start.
        "healthcheck": _http_health(REPLICA_PORT, "/health", "30m", options.tls),
        **_stop(REPLICA_STOP_S),
        "restart": "unless-stopped",
    }


def router_targets(options: ComposeOptions) -> list[RouterTarget]:
    """Each replica by service name, with the GPUs it reserves (NVML indices, host order) for telemetry;
    none in the scaled stack, where the router discovers them."""
    if options.scaled:
        return []
    return [
        RouterTarget(
            f"{options.scheme}://{replica_service(index)}:{REPLICA_PORT}",
            _gpu_list(options, index),
            f"tcp://{replica_service(index)}:{KV_EVENTS_PORT}",
            rid,  # as its Prometheus target is labelled (`_static_replica_targets`)
        )
        for index, rid in enumerate(replica_ids(options.replicas))
    ]


def _gpu_list(options: ComposeOptions, index: int) -> str:
    return ",".join(str(gpu) for gpu in options.replica_gpus(index))


def router_command(options: ComposeOptions, index: int = 0, agent: bool = True) -> list[str]:
    """Router `index`'s container command: `dpserve up`'s own router flags (router_flags), for the replica
    services. GPU telemetry and health come from the host's agent (`agent`): the router needs no GPU device.
    Every other router service is a peer, by service name: the routers share in-flight counts and routes."""
    name = router_service(index)
    settings = RouterSettings(
        host="0.0.0.0",
        port=ROUTER_PORT,
        policy=var("POLICY", "kv_aware"),
        insecure=True,
        gpu_agents=(f"http://{AGENT_SERVICE}:{AGENT_PORT}",) if agent else (),
        # With --tls, a router serving HTTPS follows https:// peers, verified against its --ssl-ca-certs.
        peers=tuple(f"{options.scheme}://{other}:{ROUTER_PORT}" for other in options.router_services if other != name),
        workers=options.router_workers,
        lora=options.lora,
        lora_dir=ADAPTERS_DIR if options.lora_dir else None,
        lora_affinity=options.lora_affinity,
        otlp_traces_endpoint=options.otlp_traces_endpoint,
        replica_api_key_file=Path(secret_path(REPLICA_KEY_SECRET)),
        replica_max_num_seqs=told_max_num_seqs(options.vllm_args),
    )
    command = list(router_flags(_with_router_tls(options, settings), router_targets(options)))
    if options.scaled:
        # Every address Docker's DNS gives for the service is a replica; KV events at the same address.
        command += ["--discover", f"dns:{SCALED_SERVICE}:{REPLICA_PORT}"]
        command += ["--discover-interval", str(DISCOVERY_INTERVAL_S), "--discover-kv-port", str(KV_EVENTS_PORT)]
    return command


def _with_router_tls(options: ComposeOptions, settings: RouterSettings) -> RouterSettings:
    """With --tls (kube_tls.with_router_tls's choices): HTTPS on its port; the CA its peers and replicas are
    checked with."""
    if not options.tls:
        return settings
    ca = Path(secret_path(CA_SECRET))
    return dataclasses.replace(
        settings,
        ssl_certfile=Path(secret_path(ROUTER_CERT)),
        ssl_keyfile=Path(secret_path(ROUTER_KEY)),
        ssl_ca_certs=ca,
        replica_ssl_ca_certs=ca,
    )


def _router_service(options: ComposeOptions, index: int = 0) -> dict[str, Any]:
    workers = options.router_workers
    reserved, limit = (f"{gib * workers}g" for gib in ROUTER_MEMORY_GIB)
    service: dict[str, Any] = {
        "build": _build(ROUTER_DOCKERFILE),
        "image": router_image(),
        "command": router_command(options, index),
        # Keys as files (secrets), read again when they change: the replicas' key, sent with every request to
        # them (--replica-api-key-file), and client and admin keys where tools/compose-secrets.sh found some.
        "environment": {f"DPSERVE_{name}": f"${{{name}:-}}" for name in KEY_FILE_VARIABLES},
        **_secrets(options, *KEY_SECRETS, *((ROUTER_CERT, ROUTER_KEY) if options.tls else ())),
        "ports": [f"{PUBLISH_ADDRESS}:{router_host_port(index)}:{ROUTER_PORT}"],
        # `default` for its published port, the agent and the other routers; `replicas` for the replicas.
        "networks": ["default", REPLICA_NETWORK],
        "read_only": True,
        "tmpfs": ["/tmp"],
        **HARDENED,
        "deploy": _resources(str(ROUTER_CPUS * workers), reserved, limit_memory=limit),
        # Its dependents stop first: on `down` the replicas serve until every router has drained.
        "depends_on": {
            **{name: {"condition": "service_healthy"} for name in options.replica_services},
            AGENT_SERVICE: {"condition": "service_started"},
        },
        "healthcheck": _http_health(ROUTER_PORT, "/ready", "1m", options.tls),
        **_stop(ROUTER_STOP_S),
        "restart": "unless-stopped",
    }
    # The batch store (SQLite, the image's XDG_DATA_HOME): one volume for every router of the stack, so they
    # share one batch queue (SQLite between processes of one host) and a restarted router resumes its batches.
    # The router lists the adapters' folder (one adapter per subfolder) as the replicas see it.
    return {**service, "volumes": [f"{ROUTER_DATA_VOLUME}:{ROUTER_DATA_DIR}", *_adapters_volume(options)]}


def _agent_service() -> dict[str, Any]:
    """One per host: every GPU's NVML reading, and which process (so which replica) holds it."""
    return {
        "build": _build(ROUTER_DOCKERFILE),
        "image": router_image(),
        "entrypoint": ["dpserve", "agent"],
        "command": ["--host", "0.0.0.0", "--port", str(AGENT_PORT)],
        # The host's process table: NVML names GPU processes by host pid, and the agent reads their sockets
        # in /proc to tell which replica listens there. Another user's /proc/PID/fd needs root with
        # CAP_DAC_READ_SEARCH (to list it) and CAP_SYS_PTRACE (to read its links); no other capability (the
        # image's user, nobody, sees none: tests/integration/test_compose_docker.py). It reads /proc, not
        # the replicas' ports: it is not on their network.
        "pid": "host",
        "user": "0:0",
        "cap_drop": ["ALL"],
        "cap_add": list(AGENT_CAPABILITIES),
        "security_opt": ["no-new-privileges:true"],
        "read_only": True,
        # NVML only (`utility`, no compute): per-GPU telemetry and health for the router.
        "deploy": _with_gpus(_resources("0.05", "64m", "0.5", "256m"), count="all", capabilities=["gpu", "utility"]),
        "healthcheck": _http_health(AGENT_PORT, "/health", "30s"),
        **_stop(OTHER_STOP_S),
        "restart": "unless-stopped",
    }


def prometheus_config(options: ComposeOptions, agent: bool = True) -> dict[str, Any]:
    if options.scaled:
        # Prometheus asks Docker's DNS too: one target per container, whatever the scale.
        vllm: dict[str, Any] = {
            "job_name": "vllm",
            "dns_sd_configs": [{"names": [SCALED_SERVICE], "type": "A", "port": REPLICA_PORT}],
        }
    else:
        vllm = {"job_name": "vllm", "static_configs": _static_replica_targets(options)}
    router = {
        "job_name": "dpserve-router",
        "static_configs": [{"targets": [f"{name}:{ROUTER_PORT}" for name in options.router_services]}],
    }
    return {
        "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
        "scrape_configs": [
            _scrape_tls(options, router),
            # DCGM-named GPU metrics, as dashboards written for NVIDIA's dcgm-exporter expect them.
            *(
                [{"job_name": "gpu-agent", "static_configs": [{"targets": [f"{AGENT_SERVICE}:{AGENT_PORT}"]}]}]
                if agent
                else []
            ),
            _scrape_tls(options, vllm),
        ],
    }


def _scrape_tls(options: ComposeOptions, job: dict[str, Any]) -> dict[str, Any]:
    """With --tls, the routers and vLLM serve HTTPS: scraped over it, checked against the stack's CA (each
    target by its service name, which its certificate covers)."""
    if not options.tls:
        return job
    return {**job, "scheme": "https", "tls_config": {"ca_file": secret_path(CA_SECRET)}}


def _static_replica_targets(options: ComposeOptions) -> list[dict[str, Any]]:
    return [
        {"targets": [f"{name}:{REPLICA_PORT}"], "labels": {"replica": rid, "gpu": _gpu_list(options, index)}}
        for index, (name, rid) in enumerate(zip(options.replica_services, replica_ids(options.replicas), strict=True))
    ]


def _monitoring_services(options: ComposeOptions) -> dict[str, dict[str, Any]]:
    return {
        "prometheus": {
            "image": var("PROMETHEUS_IMAGE", "prom/prometheus:v3.5.0"),
            "profiles": ["monitoring"],
            "configs": [{"source": "prometheus", "target": "/etc/prometheus/prometheus.yml"}],
            "volumes": ["prometheus-data:/prometheus"],
            "ports": [f"{PUBLISH_ADDRESS}:{var('PROMETHEUS_PORT', 9090)}:9090"],
            # It scrapes the replicas' /metrics (which want no key).
            "networks": ["default", REPLICA_NETWORK],
            **_secrets(options),
            # The image's user (nobody) writes only its data volume.
            "read_only": True,
            **HARDENED,
            "deploy": _resources("0.25", "512m", "1", "2g"),
            **_stop(OTHER_STOP_S),
            "restart": "unless-stopped",
        },
        "grafana": {
            "image": var("GRAFANA_IMAGE", "grafana/grafana:12.1.0"),
            "profiles": ["monitoring"],
            "depends_on": ["prometheus"],
            "environment": {
                # Never admin/admin: set it, or let `make compose-up` generate it (user `admin`).
                "GF_SECURITY_ADMIN_PASSWORD": required("GRAFANA_ADMIN_PASSWORD"),
                # Viewing without signing in only when .env asks (GRAFANA_ANONYMOUS=true).
                "GF_AUTH_ANONYMOUS_ENABLED": var("GRAFANA_ANONYMOUS", "false"),
                "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
                "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": f"{GRAFANA_DASHBOARDS_DIR}/dpserve.json",
            },
            "volumes": [
                "./monitoring/grafana/provisioning:/etc/grafana/provisioning:ro",
                f"./monitoring/grafana/dashboards:{GRAFANA_DASHBOARDS_DIR}:ro",
                "grafana-data:/var/lib/grafana",
            ],
            "ports": [f"{PUBLISH_ADDRESS}:{var('GRAFANA_PORT', 3000)}:3000"],
            # The image's user (472); its root filesystem stays writable (plugins, logs under /var).
            **HARDENED,
            "deploy": _resources("0.1", "128m", "1", "1g"),
            **_stop(OTHER_STOP_S),
            "restart": "unless-stopped",
        },
    }


def locust_commands(model: str) -> dict[str, list[str]]:
    """The master's and the workers' flags: each reads the locustfile, so each gets the workload's flags."""
    workload = ["-f", f"{LOADTESTS_DIR}/locustfile.py", "--workload", var("LOAD_WORKLOAD", "shared_prefix")]
    workload += ["--model", model]
    return {
        "locust-master": [*workload, "--master"],
        "locust-worker": [*workload, "--worker", "--master-host", "locust-master"],
    }


def _loadtest_services(options: ComposeOptions) -> dict[str, dict[str, Any]]:
    commands = locust_commands(var("MODEL", options.model))
    common = {
        "image": var("LOCUST_IMAGE", "locustio/locust:2.47.0"),
        "profiles": ["loadtest"],
        "volumes": [f"./loadtests:{LOADTESTS_DIR}:ro"],
        # The first of API_KEYS, if any: the locustfile sends OPENAI_API_KEY as its Bearer token.
        "environment": {
            "LOCUST_HOST": f"{options.scheme}://{ROUTER_SERVICE}:{ROUTER_PORT}",
            "OPENAI_API_KEY": "${API_KEYS:-}",
            # With --tls, the stack's CA for Python's and requests' clients. The locustfile's FastHttpUser checks
            # no certificate (Locust's `insecure` default): its requests are encrypted, the router not verified.
            **(
                {"REQUESTS_CA_BUNDLE": secret_path(CA_SECRET), "SSL_CERT_FILE": secret_path(CA_SECRET)}
                if options.tls
                else {}
            ),
        },
        **_secrets(options),
        # The image's user (locust); its home stays writable.
        **HARDENED,
        **_stop(OTHER_STOP_S),
    }
    resources = _resources("0.25", "128m", "1", "1g")
    return {
        "locust-master": {
            **common,
            "command": commands["locust-master"],
            "ports": [f"{PUBLISH_ADDRESS}:{var('LOCUST_PORT', 8089)}:8089"],
            "deploy": resources,
            "depends_on": {ROUTER_SERVICE: {"condition": "service_healthy"}},
        },
        "locust-worker": {
            **common,
            "command": commands["locust-worker"],
            "deploy": {"replicas": var("LOCUST_WORKERS", 2), **resources},
            "depends_on": ["locust-master"],
        },
    }


def compose_document(options: ComposeOptions) -> dict[str, Any]:
    services: dict[str, Any] = {
        name: _vllm_service(options, None if options.scaled else index)
        for index, name in enumerate(options.replica_services)
    }
    for index, name in enumerate(options.router_services):
        services[name] = _router_service(options, index)
    services[AGENT_SERVICE] = _agent_service()
    services.update(_monitoring_services(options))
    services.update(_loadtest_services(options))
    return {
        "name": "dpserve",
        "services": services,
        "networks": {REPLICA_NETWORK: {"internal": True}, EGRESS_NETWORK: {}},
        "volumes": {"hf-cache": {}, "prometheus-data": {}, "grafana-data": {}, ROUTER_DATA_VOLUME: {}},
        "configs": {"prometheus": {"content": dump(prometheus_config(options))}},
        "secrets": secrets_document(options),
    }


def _replica_deploy(cpus: str, memory: str) -> dict[str, Any]:
    """An override's replica resources: its own CPU and memory over the GPU file's, and no GPU device (the
    scaled service keeps its `replicas`)."""
    deploy = _resources(cpus, memory)
    deploy["resources"]["reservations"]["devices"] = Reset()
    return deploy


def cpu_override_document(options: ComposeOptions) -> dict[str, Any]:
    """Laid over compose.yaml: the same replicas run vllm-cpu with the tiny model, and nothing asks for a GPU."""
    command = ["--model", CPU_MODEL_DIR, "--host", "0.0.0.0", "--port", str(REPLICA_PORT)]
    command += vllm_tls_flags(options)
    # Eager: each new container compiles from an empty torch.compile cache, a minute per replica on 2 cores to
    # /health (25 s eager), and the tiny model it serves gains nothing from the compiled graph.
    command += vllm_engine_flags(
        CPU_SERVED_NAME, KV_EVENTS_PORT, CPU_MAX_MODEL_LEN, ["--enforce-eager"], **_engine(options)
    )
    command += _vllm_drain(options)
    replica = {
        "image": cpu_replica_image(),
        # TORCH_INDEX: PyTorch's CPU index unless the shell says otherwise (`none` where torch's wheel is
        # on disk, which `make compose-up` copies into replicas/wheels/).
        "build": _build(CPU_REPLICA_DOCKERFILE, TORCH_INDEX=var("TORCH_INDEX", "https://download.pytorch.org/whl/cpu")),
        "command": command,
        "environment": {
            "VLLM_CPU_KVCACHE_SPACE": var("CPU_KV_CACHE_GIB", 1),
            # Replicas in separate containers cannot see each other's core pinning: let the OS place threads.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # Its caches (vLLM's, torch's) under a home nobody can write: the tmpfs.
            "HOME": "/tmp",
        },
        # Not root, unlike vLLM's GPU image: the tiny model is in the image, readable by all, and it writes
        # nothing but caches, to /tmp.
        "user": NONROOT,
        "read_only": True,
        "tmpfs": ["/tmp"],
        "deploy": _replica_deploy("1", var("CPU_REPLICA_MEMORY", CPU_REPLICA_MEMORY)),
        "healthcheck": {"start_period": "10m"},
        # The tiny model is in the image: nothing to download.
        "networks": {EGRESS_NETWORK: Reset()},
    }
    return _override(options, replica)


def sim_override_document(options: ComposeOptions) -> dict[str, Any]:
    """Laid over compose.yaml: `dpserve sim` replicas (the router's image), so the container stack starts in
    seconds. Same ports, KV events and service names as vLLM's; health checked every 2 s."""
    command = ["--host", "0.0.0.0", "--port", str(REPLICA_PORT), "--model", CPU_SERVED_NAME]
    command += ["--kv-events", f"tcp://*:{KV_EVENTS_PORT}", "--decode-ms-per-token", var("SIM_DECODE_MS", 5)]
    if options.tls:
        command += ["--ssl-certfile", secret_path(VLLM_CERT), "--ssl-keyfile", secret_path(VLLM_KEY)]
    replica = {
        "image": router_image(),
        "build": _build(ROUTER_DOCKERFILE),
        # It reads VLLM_API_KEY as vLLM does, and writes nothing (as the router).
        "entrypoint": ["dpserve", "sim"],
        "command": command,
        "deploy": _replica_deploy("0.25", "512m"),
        "healthcheck": {"interval": "2s", "start_period": "1m"},
        "networks": {EGRESS_NETWORK: Reset()},
        "read_only": True,
        "tmpfs": ["/tmp"],
    }
    return _override(options, replica, router={"healthcheck": {"interval": "2s"}})


def _override(options: ComposeOptions, replica: dict[str, Any], router: dict[str, Any] | None = None) -> dict[str, Any]:
    services: dict[str, Any] = {name: dict(replica) for name in options.replica_services}
    # No GPU here, so no agent: the routers ask none, and Prometheus scrapes none. It stays in a profile no
    # `up` starts (and without its device), for `docker compose run`.
    for index, name in enumerate(options.router_services):
        no_agent = {"command": router_command(options, index, agent=False), "depends_on": {AGENT_SERVICE: Reset()}}
        services[name] = {**no_agent, **(router or {})}
    reservations = {"devices": Reset()}
    services[AGENT_SERVICE] = {"profiles": [AGENT_PROFILE], "deploy": {"resources": {"reservations": reservations}}}
    for name, command in locust_commands(CPU_SERVED_NAME).items():
        services[name] = {"command": command}
    return {"services": services, "configs": {"prometheus": {"content": dump(prometheus_config(options, False))}}}


def render(options: ComposeOptions, overlay: str | None = None) -> str:
    flags = options.flags()
    tail = options.vllm_flags()
    base = options.file_name()
    if overlay is not None:
        if overlay not in OVERLAYS:
            raise ValueError(f"no `{overlay}` override: one of {', '.join(OVERLAYS)}")
        if overlay == "sim" and options.vllm_args:
            raise ValueError("--sim: its replicas run `dpserve sim`, which takes no vLLM flags (none after `--`)")
        what = {
            "cpu": "The same replicas run vllm-cpu with the tiny model built into replicas/Dockerfile.cpu.",
            "sim": "The same replicas run `dpserve sim` from the router's image: the container stack in seconds.",
        }[overlay]
        header = (
            f"Generated by `dpserve compose {flags} --{overlay}{tail}`; regenerate rather than edit.\n"
            f"docker compose -f {base} -f {options.file_name(overlay)} up -d (or: make compose-up VARIANT={overlay}"
            + (" SCALED=1" if options.scaled else "")
            + (" TLS=1" if options.tls else "")
            + ")\n"
            + what
            + _tls_header(options)
        )
        document = cpu_override_document(options) if overlay == "cpu" else sim_override_document(options)
        return dump(document, header)
    if options.scaled:
        header = (
            f"Generated by `dpserve compose {flags} --model {options.model}{tail}`; regenerate rather than edit.\n"
            "One replica service, `vllm`, scaled to REPLICAS containers (docker compose up --scale vllm=N);\n"
            "the router finds them through Docker's DNS. Use it where the runtime hands each container its own\n"
            "GPU; on a plain Docker host compose.yaml pins one GPU per service. Settings come from .env."
        )
    else:
        routers = "the router" if options.routers == 1 else f"{options.routers} routers sharing state as peers"
        header = (
            f"Generated by `dpserve compose {flags} --model {options.model}{tail}`; regenerate rather than edit.\n"
            f"One vLLM service per {_replica_gpus_text(options)}, {routers}, and profiles `monitoring` "
            "(Prometheus, Grafana), "
            "`loadtest` (Locust).\n"
            'Model, images and ports come from .env. See README.md, "Run on a multi-GPU host".' + _tls_header(options)
        )
    return dump(compose_document(options), header)


def tls_command(options: ComposeOptions) -> str:
    """What makes this stack's CA and certificates (`make compose-up TLS=1` runs it)."""
    return f"tools/compose-tls.sh {' '.join(options.tls_names)}"


def _tls_header(options: ComposeOptions) -> str:
    if not options.tls:
        return ""
    return (
        "\nHTTPS on every hop, verified against a CA of the stack's own; its certificates first:\n"
        f"  {tls_command(options)}\n"
        f"Clients check the router against {SECRETS_DIR}/{TLS_DIR}/{CA_SECRET} "
        f"(curl --cacert {SECRETS_DIR}/{TLS_DIR}/{CA_SECRET} https://127.0.0.1:8000/v1/models)."
    )


def _replica_gpus_text(options: ComposeOptions) -> str:
    size = options.tensor_parallel_size
    return "GPU" if size == 1 else f"{size} GPUs (--tensor-parallel-size {size}, GPUs in index order)"
