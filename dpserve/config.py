"""Settings, one group per command (`dpserve router`, `dpserve up`, `dpserve sim`), and the one loader that
fills any of them: defaults < environment (DPSERVE_<FIELD>) < flags."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, get_type_hints

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "DPSERVE_"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dpserve"


DEFAULT_MAX_LORAS = 2
DEFAULT_MAX_LORA_RANK = 16


def parse_lora(spec: str) -> tuple[str, str]:
    """`NAME=PATH` -> (NAME, PATH); a ValueError says what is wrong."""
    name, sep, path = spec.partition("=")
    if not sep:
        raise ValueError(f"LoRA adapter {spec!r}: expected NAME=PATH")
    if not name or any(char.isspace() for char in name):
        raise ValueError(f"LoRA adapter {spec!r}: NAME must be non-empty, without whitespace")
    if not path.strip():
        raise ValueError(f"LoRA adapter {spec!r}: PATH is empty")
    return name, path


def lora_adapters(specs: tuple[str, ...]) -> dict[str, str]:
    """`--lora` specs as {NAME: PATH}; a ValueError for a malformed spec or a NAME given twice."""
    adapters: dict[str, str] = {}
    for spec in specs:
        name, path = parse_lora(spec)
        if name in adapters:
            raise ValueError(f"LoRA adapter {name!r}: given twice")
        adapters[name] = path
    return adapters


def check_lora_engine(max_loras: int, max_lora_rank: int) -> None:
    """The replicas' LoRA limits: a ValueError naming the flag unless both are positive."""
    for flag, value in (("--max-loras", max_loras), ("--max-lora-rank", max_lora_rank)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")


@dataclass(frozen=True)
class RouterSettings:
    """`dpserve router`."""

    host: str = "127.0.0.1"
    port: int = 8000
    replicas: tuple[str, ...] = ()
    policy: str | None = None
    """None: kv_aware when replicas publish KV events (`kv_events`, or discovered ones), else least_loaded."""
    kv_events: tuple[str, ...] = ()
    """`REPLICA_URL=tcp://HOST:PORT` per replica that publishes KV-cache events."""
    discover: tuple[str, ...] = ()
    """Replicas found by DNS: `dns:NAME:PORT` (A/AAAA) or `srv:_service._proto.NAME` (SRV)."""
    discover_interval_s: float = 5.0
    discover_kv_port: int = 5557
    """Where discovered replicas publish KV events (tcp://ADDRESS:PORT)."""
    discover_nameserver: str | None = None
    """`HOST[:PORT]` to ask instead of the system's resolver (resolv.conf)."""
    tokenizer: str | None = None
    """Where KV-aware routing gets token ids: a model directory with tokenizer.json (loaded in the
    router), or "remote" (the replica's /tokenize). None: the model directory when the router is
    given one, else remote."""
    kv_index_max_entries: int = 2_000_000
    prefix_index_max_chunks: int = 500_000
    token_cache_entries: int = 4096
    recent_route_ttl_s: float = 10.0
    """kv_aware: how long blocks just sent to a replica count as cached there before its events say so."""
    kv_load_weight: float = 0.05
    kv_cache_weight: float = 0.2
    kv_held_weight: float = 1.0
    kv_temperature: float = 0.0
    balance_abs: int = 8
    balance_rel: float = 1.5
    prefix_min_match: float = 0.5
    session_load_factor: float = 1.25
    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 32 * 1024
    """Request line excluded: all header names and values together."""
    connect_timeout_s: float = 5.0
    write_timeout_s: float = 60.0
    """How long a replica may take to accept a request's bytes."""
    read_timeout_s: float = 900.0
    """The longest a replica may stay silent: before the answer's first byte (a non-streamed answer
    comes only when its generation ends) and between its bytes."""
    request_timeout_s: float = 3600.0
    """One attempt at a replica, whole: from sending the request to the answer's last byte, streams included."""
    max_response_bytes: int = 64 * 1024 * 1024
    """The largest non-streamed answer relayed; past it the client gets a 502 (streams are not bounded)."""
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 3.0
    held_probe_interval_s: float = 0.1
    """While requests are held, how often a replica full only because of load that is not the routers' (other
    clients, routers without peers) has its /metrics read again: nothing else tells when that load ends."""
    fail_threshold: int = 2
    """Health probes failed in a row that eject a replica."""
    rise_threshold: int = 2
    """Health probes passed in a row that re-admit an ejected replica."""
    passive_fail_threshold: int = 3
    """Requests failed in a row (timeouts, dropped connections, 5xx) that eject a replica."""
    backpressure_backoff_s: float = 1.0
    """How long a replica that answered 429/503 is avoided while another has room."""
    retries: int = 2
    retry_backoff_s: float = 0.025
    route_sample: int = 8
    """Load-and-cache policies choose among this many replicas of a larger fleet, plus those likely to
    hold the prompt's prefix, so a decision costs the same at 64 replicas as at 8 (0: all of them)."""
    max_in_flight: int = 256
    """Per replica, the requests of this router and its peers together; past it requests wait in the
    router's queue (0: no limit). vLLM's default batch
    is 256 sequences: beyond that a request only waits inside the engine, where it can no longer move."""
    queue_size: int = 1024
    queue_timeout_s: float = 30.0
    receipts_sample: float = 0.1
    """The share of requests that get a routing receipt (predicted vs realized cached tokens, a class for
    each miss: `router/quality/receipts.py`); a request with `x-dpserve-receipt: 1` always gets one."""
    receipts_keep: int = 1024
    """Receipts kept for `GET /admin/receipts` (the newest)."""
    receipts_log: str | None = None
    """A file each receipt is appended to as a JSON line (`router/quality/receipt_log.py`)."""
    shadow_policies: tuple[str, ...] = ()
    """Policies asked, beside the live one, what they would choose (`router/quality/shadows.py`): round_robin,
    least_loaded, kv_aware."""
    flow_control: bool = True
    """Hold requests past each replica's learned capacity (`replicas/capacity.py`) in the router, and release
    them by priority, then fair share between tenants; off: first come, first served."""
    batch_reserve: float = 0.1
    """The share of each replica's slots that `batch` requests leave free for more urgent ones."""
    engine_queue: int = 1
    """Requests per replica past its capacity that flow control lets wait in the engine while one tenant
    alone fills the router's queue, so a slot that frees is filled without the router's round trip."""
    tenants: tuple[str, ...] = ()
    """Tenants' rules: `NAME:weight=2,priority=batch,max-priority=standard,rpm=60,tpm=100000,concurrent=8`
    (`*` for every tenant without its own; `router/flow/tenants.py`)."""
    vllm_priority: bool = False
    """Pass each request's class to vLLM as its `priority` field (replicas run `--scheduling-policy priority`)."""
    lora: tuple[str, ...] = ()
    """LoRA adapters, `NAME=PATH` each (the path as the replicas see it): loaded into replicas at run time."""
    lora_dir: str | None = None
    """A folder whose every subfolder is a LoRA adapter named after it (the path as the replicas see it)."""
    lora_affinity: bool = True
    """Route an adapter's requests to replicas that have it loaded; off: ignore where adapters are (a baseline)."""
    lora_slots: int = 0
    """Adapters each replica keeps loaded before the least recently used idle one is unloaded; 0: four per
    vLLM `--max-loras` (`policies/adapters.py`)."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_key_file: Path | None = None
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_key_file: Path | None = None
    insecure: bool = False
    """Serve without API keys on a non-loopback address."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM: how long requests in flight (streams included) get to finish."""
    gpu_interval_s: float = 1.0
    """Seconds between NVML samples of every GPU (and polls of each GPU agent); 0 turns GPU telemetry off."""
    gpu_agents: tuple[str, ...] = ()
    """`dpserve agent` URLs (http://HOST:9400), one per GPU host, whose GPUs the router reads."""
    discover_agents: tuple[str, ...] = ()
    """GPU agents found by DNS: `dns:NAME:PORT` (every address of NAME) or `srv:...`."""
    # GPU health (gpu/health.py): a replica on a degraded GPU takes no new requests while another has room.
    # The defaults are GpuHealthRules' (a unit test holds them equal).
    gpu_health: bool = True
    """Soft-drain replicas on degraded GPUs; off: GPU health is shown, not acted on."""
    gpu_throttle_reasons: tuple[str, ...] = ("hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
    """NVML throttle reasons that degrade a GPU (sw_power_cap is normal at full load, so not by default)."""
    gpu_ignored_xids: tuple[str, ...] = ("13", "31", "43", "45")
    """Xid codes an application's own faults raise: they do not degrade the GPU."""
    gpu_event_hold_s: float = 300.0
    """A new Xid or uncorrected ECC error keeps its GPU degraded this long."""
    gpu_degrade_after_s: float = 2.0
    """A throttle or PCIe condition must last this long before it degrades the GPU."""
    gpu_recover_after_s: float = 30.0
    """Every condition must be gone this long before the GPU's replica takes new requests again."""
    gpu_pcie_busy_utilization: float = 0.5
    """A PCIe generation below the maximum counts only while the GPU is at least this busy."""
    peers: tuple[str, ...] = ()
    """Other routers (http://HOST:PORT) this one shares routing state with (router/peers/links.py)."""
    discover_peers: tuple[str, ...] = ()
    """Other routers found by DNS: `dns:NAME:PORT` (every address of NAME; this router's own is skipped)."""
    peer_interval_s: float = 0.02
    """How stale this router's in-flight counts may be at its peers (its routes and bindings go at once)."""
    peer_timeout_s: float = 2.0
    """A peer silent this long is forgotten: its in-flight counts and bindings stop counting."""
    warm_start_timeout_s: float = 10.0
    """How long a starting router waits for a peer's snapshot (KV index, recent routes) before serving."""
    workers: int = 1
    """Router processes on this host behind one port (SO_REUSEPORT), sharing state as peers do."""
    peer_siblings: tuple[str, ...] = ()
    """Set by `--workers` for each worker: its sibling workers' private URLs (not a user setting)."""
    access_log: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        lora_adapters(self.lora)
        if self.lora_slots < 0:
            raise ValueError(f"--lora-slots {self.lora_slots}: must be 0 (four per --max-loras) or more")
        if self.lora_dir is not None and not self.lora_dir.strip():
            raise ValueError("--lora-dir must name a folder")

    @property
    def lora_adapters(self) -> dict[str, str]:
        """`--lora` as {NAME: PATH}, in the order given."""
        return lora_adapters(self.lora)

    @property
    def peering(self) -> bool:
        return bool(self.peers or self.discover_peers or self.peer_siblings)

    @property
    def routing_policy(self) -> str:
        if self.policy:
            return self.policy
        return "kv_aware" if self.kv_events or self.discover else "least_loaded"


@dataclass(frozen=True)
class UpSettings:
    """`dpserve up`: the replicas it starts, and the router it starts in front of them."""

    router: RouterSettings = field(default_factory=RouterSettings)
    num_replicas: int | None = None
    model: str | None = None
    served_model_name: str | None = None
    base_port: int = 8100
    kv_events_base_port: int = 5557
    cache_dir: Path = field(default_factory=default_cache_dir)
    run_dir: Path | None = None
    replica_start_timeout_s: float = 900.0
    cpu_kv_cache_gib: int = 1
    max_model_len: int = 4096
    vllm_args: tuple[str, ...] = ()
    sim_replicas: int = 0
    """`dpserve up --sim N`: N simulator replicas instead of vLLM."""
    routers: int = 1
    """Routers on --port, --port+1, ..., each a --peer of the others."""
    enable_lora: bool = False
    """Start vLLM replicas with LoRA enabled (implied by `router.lora` or `router.lora_dir`)."""
    max_loras: int = DEFAULT_MAX_LORAS
    """LoRA adapters each replica holds in one batch (vLLM's `--max-loras`)."""
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    """The highest adapter rank replicas accept (vLLM's `--max-lora-rank`)."""

    def __post_init__(self) -> None:
        check_lora_engine(self.max_loras, self.max_lora_rank)

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.router.lora or self.router.lora_dir)


@dataclass(frozen=True)
class SimSettings:
    """`dpserve sim`: one simulated vLLM replica."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    served_model_name: str | None = None
    max_model_len: int = 4096
    access_log: bool = False
    log_level: str = "info"
    sim_block_size: int = 16
    sim_num_blocks: int = 8192
    sim_max_num_seqs: int = 256
    sim_prefill_ms_per_token: float = 0.1
    sim_decode_ms_per_token: float = 10.0
    sim_batch_slowdown: float = 0.02
    sim_jitter: float = 0.0
    sim_seed: int = 0
    sim_speed: float = 1.0
    sim_tokenizer: str = "tiny"
    sim_kv_events: str | None = None
    """ZMQ endpoint the sim publishes KV events on, e.g. tcp://127.0.0.1:5557 (none: no events)."""


@dataclass(frozen=True)
class AgentSettings:
    """`dpserve agent`: one per GPU host, serving that host's NVML readings to routers elsewhere."""

    host: str = "0.0.0.0"
    """All addresses by default, as DCGM's exporter: routers on other hosts read it. It serves
    readings only (no prompts, no keys); keep port 9400 inside the cluster's network."""
    port: int = 9400
    interval_s: float = 1.0
    """Seconds between NVML readings."""
    hostname: str | None = None
    """The name the agent reports (default: the machine's host name; a Kubernetes node name)."""
    nvml: str | None = None
    """`MODULE:CALLABLE` returning a pynvml-like module, in place of pynvml (a GPU-less rehearsal)."""
    access_log: bool = False
    log_level: str = "info"


S = TypeVar("S", bound="DataclassInstance")


def load_settings(
    group: type[S], overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> S:
    """`group` from environment variables and explicit overrides (flags, by field name; `None` is unset
    and names of other groups are ignored). A group inside a group (`UpSettings.router`) is loaded from
    the same environment and flags."""
    env = os.environ if env is None else env
    overrides = overrides or {}
    hints = get_type_hints(group)
    values: dict[str, Any] = {}
    for f in fields(group):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            values[f.name] = load_settings(hint, overrides, env)
            continue
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is not None and raw != "":
            values[f.name] = _coerce(f.name, hint, raw)
        if overrides.get(f.name) is not None:
            values[f.name] = overrides[f.name]
    return group(**values)


def split_list(text: str) -> tuple[str, ...]:
    """`a,b c` -> ("a", "b", "c"): how a list setting is written in a flag or an environment variable."""
    return tuple(text.replace(",", " ").split())


TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
"""What a setting in the environment, or a yes-or-no request header, reads as true."""
FALSE_WORDS = frozenset({"0", "false", "no", "off"})

SPACE_SEPARATED = frozenset({"tenants"})
"""List settings whose items hold commas themselves: separated by whitespace or `;` in the environment."""


def _coerce(name: str, hint: Any, raw: str) -> Any:
    text = str(hint)
    try:
        if "tuple" in text:
            return tuple(raw.replace(";", " ").split()) if name in SPACE_SEPARATED else split_list(raw)
        if "bool" in text:
            if raw.lower() in TRUE_WORDS:
                return True
            if raw.lower() in FALSE_WORDS:
                return False
            raise ValueError(raw)
        if "int" in text and "float" not in text:
            return int(raw)
        if "float" in text:
            return float(raw)
        if "Path" in text:
            return Path(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid value") from None
    return raw
