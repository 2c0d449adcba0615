"""Settings, one group per command (`dpserve router`, `dpserve up`, `dpserve sim`, `dpserve agent`), each setting
declared once (`setting`: its default, help, flag, environment variable and help group), and the one loader that
fills any group: defaults < environment (`DPSERVE_<FLAG>`) < a config file (`--config FILE`, YAML keyed by the
flags' names) < flags, every value checked by pydantic against its field's type hint and bounds. The flags are
generated from the same declarations (`dpserve/cli.py`), as is `dpserve up`'s command line for its router
(`settings_argv`)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    ClassVar,
    Literal,
    Optional,
    TypeVar,
    get_args,
    get_origin,
    get_type_hints,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger("dpserve.config")

ENV_PREFIX = "DPSERVE_"


class Form(Enum):
    """How a setting is written on the command line."""

    VALUE = "value"  # --flag VALUE
    REPEAT = "repeat"  # --flag ITEM, once per item (a list; its variable is the setting's plural name)
    LIST = "list"  # --flag A,B (a list replaced whole)
    SWITCH = "switch"  # --flag turns it on
    OFF_SWITCH = "off_switch"  # --no-... turns it off (its variable is the setting's name)
    ON_OFF = "on_off"  # --flag on|off


@dataclass(frozen=True)
class Setting:
    """One setting's declaration, kept in its dataclass field's metadata (`setting` writes it)."""

    help: str
    group: str
    """The help section it is listed in; for the router, one section per part the settings build
    (`Deadlines`, `HealthRules`, `GpuHealthRules`, `PolicyTuning`, `Admission`, ...)."""
    flag: str | None
    """None: no flag (`internal`), or given another way (`dpserve up -- VLLM ARGS`)."""
    env: str | None
    """None: not read from the environment."""
    aliases: tuple[str, ...]
    """Older names of `env`, still read, with a warning."""
    form: Form
    metavar: str | None
    choices: tuple[str, ...] | None
    router_only: bool
    """Only `dpserve router` takes the flag (`dpserve up` sets it itself: replicas, events, peers)."""
    secret: bool
    """Never on a command line (`ps` shows it to every user): `dpserve up` hands it on in the environment."""
    hidden: bool
    separator: str
    """What separates a list's items in the environment, besides whitespace."""
    minimum: float | None
    """The least a number may be (none: 0; a port 0 too)."""
    maximum: float | None
    """The most a number may be (none: a port's 65535, else LARGEST_INT or LARGEST_FLOAT)."""
    old_flags: tuple[str, ...]
    """Older names of `flag`, still taken."""


SETTING = "dpserve.setting"


def setting(
    default: Any,
    help: str,
    group: str,
    *,
    flag: str | None = "",
    env: str | None = "",
    form: Form | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    router_only: bool = False,
    secret: bool = False,
    hidden: bool = False,
    separator: str = ",",
    minimum: float | None = None,
    maximum: float | None = None,
    old_flags: tuple[str, ...] = (),
) -> Any:
    """A dataclass field declaring a setting. `flag` and `env` left out are derived from the field's name when the
    class is declared (`declared`): `--read-timeout` for `read_timeout_s`, `DPSERVE_READ_TIMEOUT` for that flag."""
    if form is None:
        form = Form.SWITCH if default is False else Form.VALUE
    declaration = {
        "help": help,
        "group": group,
        "flag": flag,
        "env": env,
        "form": form,
        "metavar": metavar,
        "choices": choices,
        "router_only": router_only,
        "secret": secret,
        "hidden": hidden,
        "separator": separator,
        "minimum": minimum,
        "maximum": maximum,
        "old_flags": old_flags,
    }
    if callable(default):
        return field(default_factory=default, repr=not secret, metadata={SETTING: declaration})
    return field(default=default, repr=not secret, metadata={SETTING: declaration})


S = TypeVar("S", bound="DataclassInstance")


@functools.cache
def settings_of(group: type[DataclassInstance]) -> tuple[tuple[str, Setting], ...]:
    """(field name, declaration) of every user setting of `group`, in declaration order. A flag or variable the
    field left out is derived from its name: the flag `--NAME` (less a trailing `_s`, and less the group's
    `FLAG_SCOPE`, which its command's flags do not repeat: `sim_block_size` is `dpserve sim --block-size`); the
    variable `DPSERVE_` + the flag's name, with the scope (`DPSERVE_SIM_BLOCK_SIZE`), or, for a repeated flag or a
    `--no-...` one, the setting's own name (`--replica` -> `DPSERVE_REPLICAS`). The name every setting was read by
    before, `DPSERVE_<FIELD>`, stays an alias where it differs."""
    scope: str = getattr(group, "FLAG_SCOPE", "")
    found = []
    for f in fields(group):
        raw = f.metadata.get(SETTING)
        if raw is not None:
            found.append((f.name, _complete(f.name, scope, raw)))
    return tuple(found)


def _complete(name: str, scope: str, raw: dict[str, Any]) -> Setting:
    scoped = bool(scope) and name.startswith(scope)
    flag = raw["flag"]
    if flag == "":
        flag = "--" + name.removeprefix(scope).removesuffix("_s").replace("_", "-")
    env = raw["env"]
    if env == "":
        if raw["form"] in (Form.REPEAT, Form.OFF_SWITCH) or flag is None:
            env = ENV_PREFIX + name.upper()
        else:
            env = ENV_PREFIX + (scope.upper() if scoped else "") + flag.removeprefix("--").replace("-", "_").upper()
    old = ENV_PREFIX + name.upper()
    aliases = (old,) if env is not None and old != env else ()
    rest = {key: value for key, value in raw.items() if key not in ("flag", "env")}
    return Setting(flag=flag, env=env, aliases=aliases, **rest)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dpserve"


def default_data_dir() -> Path:
    """Where the router keeps what must outlive it (the batch store), as the XDG base directories say."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
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


def check_tensor_parallel_size(size: int) -> None:
    """A ValueError for a size no replica can have (`dpserve up`, `compose` and `kube` alike)."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size {size}: at least 1 GPU per replica")


# The router's help groups. RouterSettings stays flat (its readers in dpserve/router/ read `settings.NAME`); each
# group is what one constructor in dpserve/router/app.py builds its part from: ROUTING policy_tuning and
# selector_for, UPSTREAM upstream_deadlines (and RetryRules), HEALTH health_rules (and ReplicaMonitor), FLOW
# admission_for and flow_for, LORA registry_for, RECEIPTS ReceiptBook and shadow_scorer, GPUS gpu_fleet, GPU_HEALTH
# gpu_health_rules, PEERS peer_links, SECURITY flow/access.py's load_keys, TLS serve.py's uvicorn config.
SERVING = "serving"
REPLICAS = "replicas and discovery"
ROUTING = "routing"
KV = "KV and prefix indexes"
UPSTREAM = "upstream timeouts and retries"
HEALTH = "replica health"
FLOW = "flow control"
RECEIPTS = "receipts and shadow policies"
LORA = "LoRA"
SECURITY = "security"
TLS = "TLS on the router's port"
GPUS = "GPU telemetry"
GPU_HEALTH = "GPU health"
PEERS = "peers"
LOGGING = "logging"
REPLICA_ACCESS = "keys and TLS to replicas"
BATCH = "batches (/v1/files, /v1/batches)"
SCALE = "elastic replicas (/admin/scale, dpserve_desired_replicas)"

LOG_LEVELS = ("debug", "info", "warning", "error")
SCHEDULING_POLICIES = ("fcfs", "priority")
"""vLLM's `--scheduling-policy` values, as the simulated engine orders its queue."""
DNS_SOURCE = "dns:NAME:PORT|srv:_service._proto.NAME"


@dataclass(frozen=True)
class RouterSettings:
    """`dpserve router`."""

    host: str = setting("127.0.0.1", "address the router binds", SERVING)
    port: int = setting(8000, "router port", SERVING)
    workers: int = setting(
        1,
        "router processes on this host behind the one port (SO_REUSEPORT), sharing state as peers do",
        SERVING,
        minimum=1,
    )
    # vLLM takes audio uploads of up to VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25 MiB by default, its largest upload
    # limit): the router's bound leaves room for one of those and the form's other fields.
    max_body_bytes: int = setting(32 * 1024 * 1024, "largest request body accepted", SERVING, minimum=1)
    max_header_bytes: int = setting(
        32 * 1024,
        "largest total of request headers, names and values (the request line excluded)",
        SERVING,
        minimum=1,
    )
    shutdown_grace_s: float = setting(
        30.0, "on SIGTERM, seconds requests in flight (streams included) get to finish", SERVING
    )
    replicas: tuple[str, ...] = setting(
        (),
        "a replica's base URL, e.g. http://127.0.0.1:8100, optionally with a name and the GPU it runs on "
        "(gpu-a=http://10.0.0.2:8000@gpu=1, an NVML index or UUID); its name in metrics, /status, logs and "
        "traces is NAME, else its address (10.0.0.2:8000), alike in every router; repeat for each replica",
        REPLICAS,
        flag="--replica",
        form=Form.REPEAT,
        metavar="[NAME=]URL[@gpu=N]",
        router_only=True,
    )
    discover: tuple[str, ...] = setting(
        (),
        "find replicas by DNS: every A/AAAA address of NAME at PORT, or every SRV record's host and port; "
        "repeatable, with or without --replica",
        REPLICAS,
        form=Form.REPEAT,
        metavar=DNS_SOURCE,
        router_only=True,
    )
    discover_interval_s: float = setting(5.0, "seconds between DNS lookups", REPLICAS, router_only=True)
    discover_kv_port: int = setting(
        5557, "where discovered replicas publish KV events (tcp://ADDRESS:PORT)", REPLICAS, router_only=True
    )
    discover_nameserver: str | None = setting(
        None,
        "DNS server to ask instead of the system's (/etc/resolv.conf)",
        REPLICAS,
        metavar="HOST[:PORT]",
        router_only=True,
    )
    kv_events: tuple[str, ...] = setting(
        (),
        "subscribe to a replica's KV-cache events (ZMQ), e.g. http://127.0.0.1:8100=tcp://127.0.0.1:5557; repeatable "
        "(a policy that reads no blocks only watches the stream's link)",
        REPLICAS,
        form=Form.REPEAT,
        metavar="REPLICA_URL=tcp://HOST:PORT",
        router_only=True,
    )
    policy: str | None = setting(
        None,
        "routing policy (none: slo, which routes requests that carry an SLO to replicas predicted to meet it and "
        "otherwise chooses as kv_aware does when replicas publish KV events, else as least_loaded)",
        ROUTING,
    )
    slo_headroom: float = setting(
        1.0,
        "slo: the share of a request's SLO its predicted time must fit within (below 1 leaves room for error)",
        ROUTING,
        minimum=0.1,
        maximum=2.0,
    )
    route_sample: int = setting(
        8,
        "load and cache policies weigh this many replicas of a larger fleet per request, plus those likely to "
        "hold the prompt's prefix, so a decision costs the same at 64 replicas as at 8 (0: all of them)",
        ROUTING,
    )
    kv_load_weight: float = setting(0.05, "kv_aware: cost per request in flight", ROUTING)
    kv_cache_weight: float = setting(0.2, "kv_aware: cost of a full KV cache", ROUTING)
    kv_held_weight: float = setting(1.0, "kv_aware: new prefixes avoid replicas owning more cache", ROUTING)
    kv_temperature: float = setting(0.0, "kv_aware: softmax temperature (0: the best replica always)", ROUTING)
    balance_abs: int = setting(8, "affinity guard: extra requests a preferred replica may have", ROUTING)
    balance_rel: float = setting(1.5, "affinity guard: load ratio a preferred replica may have", ROUTING)
    prefix_min_match: float = setting(
        0.5, "prefix: the share of a prompt that must match to follow it", ROUTING, maximum=1
    )
    session_load_factor: float = setting(
        1.25, "session: load ratio past which a session moves off its replica", ROUTING
    )
    tokenizer: str | None = setting(
        None,
        "token ids for kv_aware: a model directory with tokenizer.json (loaded in the router), or `remote` (the "
        "replica's /tokenize); none: each model's own tokenizer where a copy is found here (the replicas' --model "
        "path, the Hugging Face cache), once it agrees with the replicas' /tokenize, else remote",
        KV,
        metavar="DIR|remote",
    )
    kv_index_max_entries: int = setting(2_000_000, "KV index bound, in blocks (about 460 bytes each)", KV)
    prefix_index_max_chunks: int = setting(500_000, "prefix policy's index bound, in chunks", KV)
    token_cache_entries: int = setting(4096, "prompts whose token ids are kept (kv_aware)", KV)
    recent_route_ttl_s: float = setting(
        10.0, "kv_aware: seconds blocks just sent to a replica count as cached there before its events say so", KV
    )
    connect_timeout_s: float = setting(5.0, "seconds to connect to a replica", UPSTREAM)
    write_timeout_s: float = setting(60.0, "seconds a replica may take to accept a request's bytes", UPSTREAM)
    read_timeout_s: float = setting(
        900.0,
        "longest silence of a replica, before the answer's first byte (a non-streamed answer comes only when "
        "its generation ends) and between its bytes",
        UPSTREAM,
    )
    request_timeout_s: float = setting(
        3600.0, "one attempt at a replica, whole: request sent to the answer's last byte, streams included", UPSTREAM
    )
    max_response_bytes: int = setting(
        64 * 1024 * 1024,
        "largest non-streamed answer relayed; past it the client gets a 502 (streams are not bounded)",
        UPSTREAM,
    )
    retries: int = setting(2, "other replicas tried before the answer's first byte", UPSTREAM)
    retry_backoff_s: float = setting(
        0.025,
        "seconds before the first retry, doubled for each later one up to 0.5 s (or this, if longer); jittered",
        UPSTREAM,
    )
    # What the router shows its replicas (replicas/access.py, built by parts.replica_access): a key and TLS.
    replica_api_key: str | None = setting(
        None,
        "the key the replicas' vLLM was started with (`--api-key`), sent to them as `Authorization: Bearer KEY`",
        REPLICA_ACCESS,
        metavar="KEY",
        secret=True,
    )
    replica_api_key_file: Path | None = setting(
        None,
        "file holding the replicas' key (its first line; the safer way to give it)",
        REPLICA_ACCESS,
        metavar="FILE",
    )
    replica_ssl_ca_certs: Path | None = setting(
        None,
        "CA bundle (PEM) that https:// replicas' certificates are verified against (none: the system's)",
        REPLICA_ACCESS,
        metavar="PEM",
    )
    replica_ssl_certfile: Path | None = setting(
        None,
        "client certificate (PEM) shown to https:// replicas that ask for one (mTLS)",
        REPLICA_ACCESS,
        metavar="PEM",
    )
    replica_ssl_keyfile: Path | None = setting(
        None,
        "the client certificate's private key (PEM; none: in --replica-ssl-certfile)",
        REPLICA_ACCESS,
        metavar="PEM",
    )
    probe_interval_s: float = setting(1.0, "seconds between health probes", HEALTH)
    probe_timeout_s: float = setting(3.0, "seconds a health probe may take", HEALTH)
    quiet_probe_interval_s: float = setting(
        10.0,
        "seconds between reads of a quiet replica (healthy, nothing running or waiting at its last read, no "
        "request of this router's or its peers' on it, no KV event since): its /metrics, and its /health too "
        "while its KV-event stream is connected (a replica that dies drops it, and is probed at once); anything "
        "that stirs it brings it back to every --probe-interval. 0: every replica every --probe-interval",
        HEALTH,
    )
    linked_quiet_probe_interval_s: float = setting(
        30.0,
        "seconds between reads of /health (only) of a quiet replica whose KV-event stream is connected: its events "
        "show any work that stores a KV block, from this router or not, and bring it back to every "
        "--probe-interval; one that dies drops the stream and is probed at once. Below --quiet-probe-interval: "
        "that interval",
        HEALTH,
    )
    held_probe_interval_s: float = setting(
        0.1,
        "while requests are held, seconds between reads of /metrics of a replica full only because of load that "
        "is not the routers' (other clients, routers without peers): nothing else tells when that load ends",
        HEALTH,
    )
    fail_threshold: int = setting(2, "health probes failed in a row that eject a replica", HEALTH, minimum=1)
    rise_threshold: int = setting(
        2, "health probes passed in a row that re-admit an ejected replica", HEALTH, minimum=1
    )
    passive_fail_threshold: int = setting(
        3, "requests failed in a row (timeouts, dropped connections, 5xx) that eject a replica", HEALTH
    )
    backpressure_backoff_s: float = setting(
        1.0, "seconds a replica that answered 429/503 is avoided while another has room", HEALTH
    )
    max_in_flight: int = setting(
        256,
        "per replica, the requests of this router and its peers together; past it requests wait in the router's "
        "queue (0: no limit). vLLM's default batch is 256 sequences: beyond that a request only waits inside the "
        "engine, where it can no longer move",
        FLOW,
    )
    queue_size: int = setting(1024, "requests the router queues", FLOW)
    queue_timeout_s: float = setting(30.0, "seconds a request may queue before a 429", FLOW)
    flow_control: bool = setting(
        True,
        "hold requests past each replica's learned capacity and release them by priority, then fair share "
        "between tenants; off: first come, first served",
        FLOW,
        form=Form.ON_OFF,
    )
    batch_reserve: float = setting(
        0.1,
        "the share of each replica's slots that `batch` requests leave free for more urgent ones while those come "
        "(and of the fleet's batch slots, /v1/batches' lines: never the last)",
        FLOW,
        maximum=1,
    )
    slo_reserve: float = setting(
        0.5,
        "the most of each replica's slots that best-effort requests leave free for requests with an SLO: their "
        "share of recent requests, up to this, while such requests have come in the last 30 s",
        FLOW,
        maximum=1,
    )
    engine_queue: int = setting(
        1,
        "requests per replica past its capacity that may wait in the engine while one tenant alone fills the "
        "router's queue, so a slot that frees is filled without the router's round trip (0: none)",
        FLOW,
    )
    tenants: tuple[str, ...] = setting(
        (),
        "a tenant's rules, e.g. acme:weight=2,priority=standard,max-priority=critical,rpm=600,tpm=200000,"
        "concurrent=32,trusted=false,slo-ttft-ms=300,slo-tpot-ms=50,slo=refuse (slo=queue: sent anyway when no "
        "replica is predicted to meet the SLO); NAME * for every tenant without its own; repeatable (in the "
        "environment separated by whitespace or ;)",
        FLOW,
        flag="--tenant",
        form=Form.REPEAT,
        metavar="NAME:RULES",
        separator=";",
    )
    vllm_priority: bool = setting(
        False,
        "pass each request's class to vLLM as its `priority` field (replicas run --scheduling-policy priority)",
        FLOW,
    )
    receipts_sample: float = setting(
        0.1,
        "share of requests given a routing receipt, 0 to 1 (predicted vs realized cached tokens; a request with "
        "`x-dpserve-receipt: 1` always gets one; /admin/receipts, dpserve_receipts_total)",
        RECEIPTS,
        maximum=1,
    )
    receipts_keep: int = setting(1024, "routing receipts kept for /admin/receipts (the newest)", RECEIPTS)
    receipts_log: str | None = setting(
        None, "append every routing receipt to PATH (JSON lines)", RECEIPTS, metavar="PATH"
    )
    shadow_policies: tuple[str, ...] = setting(
        (),
        "also ask this policy what it would choose, and estimate its cache hits (round_robin, least_loaded, "
        "kv_aware; repeatable; /status shadows, dpserve_shadow_*)",
        RECEIPTS,
        flag="--shadow-policy",
        form=Form.REPEAT,
        metavar="NAME",
    )
    lora: tuple[str, ...] = setting(
        (),
        "a LoRA adapter the router loads into replicas at run time, PATH as the replicas see it; repeatable",
        LORA,
        form=Form.REPEAT,
        metavar="NAME=PATH",
    )
    lora_dir: str | None = setting(
        None,
        "a folder whose every subfolder is a LoRA adapter named after it, as the replicas see it",
        LORA,
        metavar="DIR",
    )
    lora_affinity: bool = setting(
        True,
        "route an adapter's requests to replicas that have it loaded; off: ignore where adapters are (a baseline)",
        LORA,
        form=Form.ON_OFF,
    )
    lora_slots: int = setting(
        0,
        "adapters each replica keeps loaded before its least recently used idle one is unloaded (0: four per "
        "replica's --max-loras)",
        LORA,
    )
    api_keys: tuple[str, ...] = setting(
        (),
        "a key clients must send as `Authorization: Bearer KEY`; NAME is its tenant; repeatable",
        SECURITY,
        flag="--api-key",
        form=Form.REPEAT,
        metavar="[NAME:]KEY",
        secret=True,
    )
    api_key_file: Path | None = setting(None, "file of API keys, one per line (# comments)", SECURITY)
    admin_keys: tuple[str, ...] = setting(
        (),
        "a key for the admin API (/admin/replicas) and /status; repeatable",
        SECURITY,
        flag="--admin-key",
        form=Form.REPEAT,
        metavar="KEY",
        secret=True,
    )
    admin_key_file: Path | None = setting(None, "file of admin keys, one per line", SECURITY)
    metrics_key_file: Path | None = setting(
        None,
        "file of keys, one per line, that read /metrics (sent as `Authorization: Bearer KEY`, as Prometheus's "
        "`authorization` does; an admin key reads it too); none: /metrics is open to whoever reaches the port",
        SECURITY,
    )
    tenant_file: Path | None = setting(
        None, "file of tenant rules, one per line as --tenant takes them (# comments), besides any --tenant", SECURITY
    )
    secret_check_interval_s: float = setting(
        1.0,
        "seconds between looks at the files secrets come from (--api-key-file, --admin-key-file, --metrics-key-file, "
        "--tenant-file, "
        "--replica-api-key-file, the TLS files): a changed one is read again and in force for the next request, "
        "without a restart (a wrong one keeps the one in force); 0: read once at start",
        SECURITY,
    )
    insecure: bool = setting(False, "allow serving without API keys on an address other than loopback", SECURITY)
    # TLS on the router's own port, with vLLM's flags (and uvicorn's: the router hands them to it). Only
    # `dpserve router` takes them: `dpserve up` would have to reach its routers over HTTPS itself (their
    # readiness, each other as peers), with a client certificate of its own where they require one.
    ssl_keyfile: Path | None = setting(
        None, "the router's TLS private key (PEM), for --ssl-certfile", TLS, metavar="FILE", router_only=True
    )
    ssl_certfile: Path | None = setting(
        None,
        "serve HTTPS only, with this certificate chain (PEM; its key too unless --ssl-keyfile)",
        TLS,
        metavar="FILE",
        router_only=True,
    )
    ssl_ca_certs: Path | None = setting(
        None, "CA certificates (PEM) a client's certificate is checked against", TLS, metavar="FILE", router_only=True
    )
    ssl_cert_reqs: int = setting(
        int(ssl.CERT_NONE),
        "client certificates, as Python's ssl.CERT_* values (vLLM's flag): 0 not asked, 1 checked when sent, "
        "2 required",
        TLS,
        metavar="0|1|2",
        router_only=True,
    )
    gpu_interval_s: float = setting(
        1.0, "seconds between NVML samples of every GPU (and polls of each GPU agent); 0: GPU telemetry off", GPUS
    )
    gpu_agents: tuple[str, ...] = setting(
        (),
        "a `dpserve agent` (http://HOST:9400) whose GPUs the router reads; repeat per GPU host. Given agents, the "
        "router reads no GPUs itself",
        GPUS,
        flag="--gpu-agent",
        form=Form.REPEAT,
        metavar="URL",
        router_only=True,
    )
    discover_agents: tuple[str, ...] = setting(
        (),
        "find GPU agents by DNS, as --discover finds replicas; repeatable",
        GPUS,
        form=Form.REPEAT,
        metavar=DNS_SOURCE,
        router_only=True,
    )
    # A replica on a degraded GPU takes no new requests while another has room. The defaults are
    # GpuHealthRules' (a unit test holds them equal).
    gpu_health: bool = setting(
        True,
        "soft-drain replicas on degraded GPUs; --no-gpu-health: show GPU health in /status and /metrics, but do "
        "not drain",
        GPU_HEALTH,
        flag="--no-gpu-health",
        form=Form.OFF_SWITCH,
    )
    gpu_throttle_reasons: tuple[str, ...] = setting(
        ("hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"),
        "NVML throttle reasons that degrade a GPU (sw_power_cap is normal at full load, so not by default)",
        GPU_HEALTH,
        form=Form.LIST,
        metavar="R1,R2",
    )
    gpu_ignored_xids: tuple[str, ...] = setting(
        ("13", "31", "43", "45"),
        "Xid codes an application's own faults raise: they do not degrade the GPU",
        GPU_HEALTH,
        form=Form.LIST,
        metavar="X1,X2",
    )
    gpu_event_hold_s: float = setting(
        300.0, "seconds a new Xid or uncorrected ECC error keeps its GPU degraded", GPU_HEALTH
    )
    gpu_degrade_after_s: float = setting(
        2.0, "seconds a throttle or PCIe condition must last before it degrades the GPU", GPU_HEALTH
    )
    gpu_recover_after_s: float = setting(
        30.0, "seconds every condition must be gone before the GPU's replica takes new requests again", GPU_HEALTH
    )
    gpu_pcie_busy_utilization: float = setting(
        0.5,
        "utilization from which a PCIe generation below the maximum counts",
        GPU_HEALTH,
        flag="--gpu-pcie-busy",
        maximum=1,
    )
    peers: tuple[str, ...] = setting(
        (),
        "another router (http://HOST:PORT) to share routing state with; repeat per router",
        PEERS,
        flag="--peer",
        form=Form.REPEAT,
        metavar="URL",
        router_only=True,
    )
    discover_peers: tuple[str, ...] = setting(
        (),
        "find the other routers by DNS (this router's own address is skipped); repeatable",
        PEERS,
        form=Form.REPEAT,
        metavar="dns:NAME:PORT",
        router_only=True,
    )
    peer_interval_s: float = setting(0.02, "seconds peers' view of this router's in-flight counts may lag", PEERS)
    peer_timeout_s: float = setting(
        2.0, "seconds before a silent peer is forgotten (its in-flight counts and bindings stop counting)", PEERS
    )
    warm_start_timeout_s: float = setting(
        10.0, "seconds a starting router waits for a peer's snapshot (KV index, recent routes) before serving", PEERS
    )
    peer_siblings: tuple[str, ...] = ()
    """Set by `--workers` for each worker: its sibling workers' private URLs (not a user setting)."""
    access_log: bool = setting(
        False,
        "log every request: one line at its end, with its id, tenant, replica, policy, status and duration",
        LOGGING,
    )
    log_level: str = setting("info", "log level", LOGGING, choices=LOG_LEVELS)
    log_format: str = setting(
        "text",
        "text for a terminal, or json: one object per line (time, level, logger, message, and a request's "
        "fields), uvicorn's lines included",
        LOGGING,
        choices=("text", "json"),
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        "export each request's trace (OpenTelemetry, OTLP) to URL, as vLLM's flag of the same name; the "
        "replicas get its context in `traceparent`; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_TRACES_SAMPLER "
        "and the other OTEL_ variables apply",
        LOGGING,
        metavar="URL",
    )

    batch_store: str | None = setting(
        None,
        "where files and batches are kept: a SQLite file (created), `postgresql://...` for a tier of routers "
        "sharing one batch queue (each line run by one of them), or `off`; by default "
        "$XDG_DATA_HOME/dpserve/batches-PORT.sqlite3",
        BATCH,
        metavar="PATH|postgresql://...|off",
    )
    batch_file_max_bytes: int = setting(
        200 * 1024 * 1024, "largest file uploaded for a batch (OpenAI's limit)", BATCH, minimum=1
    )
    batch_file_max_lines: int = setting(50_000, "most requests in one batch file (OpenAI's limit)", BATCH, minimum=1)
    batch_slots: int = setting(
        1,
        "batch requests per replica while no other request runs there; other requests take those slots back "
        "(with flow control, a replica's learned capacity less --batch-reserve bounds it too)",
        BATCH,
        minimum=0,
    )
    batch_lease_s: float = setting(
        10.0,
        "seconds a router's claim on batch lines outlives its last heartbeat: a router killed mid-batch has "
        "its unfinished lines run again, by itself restarted or by a peer, after this",
        BATCH,
        minimum=1,
    )
    batch_poll_interval_s: float = setting(
        1.0, "seconds between looks at the store for batches created elsewhere (peers, before a restart)", BATCH
    )

    scale_target: float = setting(
        0.8,
        "share of its replicas' measured capacity (requests at once) the desired-replicas signal aims the load "
        "at: one more replica is asked for above it",
        SCALE,
        minimum=0.05,
        maximum=1.0,
    )
    scale_spread: float = setting(
        1.0,
        "headroom the desired-replicas signal adds over the smoothed load, in its standard deviations (the square "
        "root of the load: requests arriving at random come in bursts that size); replicas that run few requests "
        "at once queue in every burst without it; 0: --scale-target alone",
        SCALE,
        minimum=0,
    )
    replica_max_num_seqs: int | None = setting(
        None,
        "the replicas' vLLM --max-num-seqs: what the desired-replicas signal, and kv_aware placing a new prefix, "
        "take a replica to run at once until its metrics show it (flow control still waits for those); "
        "`dpserve up`, compose and kube pass the one given after `--`",
        SCALE,
        metavar="N",
        minimum=1,
    )
    scale_down_delay_s: float = setting(
        30.0,
        "seconds every look must find the load fitting in fewer replicas (at --scale-target less a fifth) before "
        "the signal lets any go, then to the most any look of the last such span needed; never less than twice a "
        "replica's measured start-up",
        SCALE,
        minimum=0,
    )
    cold_start_wait_s: float = setting(
        0.0,
        "when no replica serves the model, a request waits up to this long for one to start (the signal asks "
        "for one), else 503 with Retry-After at once when the measured start-up would take longer; 0: 503 at "
        "once (a fleet that never scales to zero)",
        SCALE,
        minimum=0,
    )

    def __post_init__(self) -> None:
        lora_adapters(self.lora)
        if self.lora_slots < 0:
            raise ValueError(f"--lora-slots {self.lora_slots}: must be 0 (four per --max-loras) or more")
        if self.lora_dir is not None and not self.lora_dir.strip():
            raise ValueError("--lora-dir must name a folder")
        check_tls(self.ssl_keyfile, self.ssl_certfile, self.ssl_ca_certs, self.ssl_cert_reqs)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """`--lora` as {NAME: PATH}, in the order given."""
        return lora_adapters(self.lora)

    @property
    def peering(self) -> bool:
        return bool(self.peers or self.discover_peers or self.peer_siblings)

    @property
    def routing_policy(self) -> str:
        return self.policy or "slo"

    @property
    def slo_inner_policy(self) -> str:
        """What `slo` chooses with among the replicas that can meet a request's SLO (and for best effort)."""
        return "kv_aware" if self.kv_events or self.discover else "least_loaded"


def check_tls(keyfile: Path | None, certfile: Path | None, ca_certs: Path | None, cert_reqs: int) -> None:
    """A ValueError naming the flag when the TLS flags do not make sense together (the files themselves are
    read when the router starts)."""
    if cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError(f"--ssl-cert-reqs {cert_reqs}: must be 0 (none), 1 (optional) or 2 (required)")
    if certfile is None and (keyfile is not None or ca_certs is not None or cert_reqs != ssl.CERT_NONE):
        raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile (TLS on)")
    if cert_reqs != ssl.CERT_NONE and ca_certs is None:
        raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs: the CA client certificates are checked against")


UP = "replicas `dpserve up` starts"
ENGINE_LORA = "LoRA in the replicas (vLLM's flags)"


@dataclass(frozen=True)
class UpSettings:
    """`dpserve up`: the replicas it starts, and the router it starts in front of them."""

    router: RouterSettings = field(default_factory=RouterSettings)
    num_replicas: int | None = setting(
        None,
        "replica count (none: one per GPU, else 2)",
        UP,
        flag="--replicas",
        env="DPSERVE_NUM_REPLICAS",  # DPSERVE_REPLICAS is the router's list of URLs
        minimum=1,
    )
    min_replicas: int | None = setting(
        None,
        "elastic: the fewest replicas kept running (0: none while idle, the first request waits for one, see "
        "--cold-start-wait); with --max-replicas, replicas start and drain as the router's desired-replicas "
        "signal says. Equal to --max-replicas (or neither given): a fixed fleet",
        UP,
        minimum=0,
    )
    max_replicas: int | None = setting(
        None, "elastic: the most replicas started (GPUs or CPU core sets are planned for this many)", UP, minimum=1
    )
    model: str | None = setting(None, "model path or name (none: the built-in tiny model, built on first use)", UP)
    served_model_name: str | None = setting(None, "name clients use for the model", UP)
    base_port: int = setting(8100, "first replica port", UP)
    kv_events_base_port: int = setting(5557, "first KV-event port", UP)
    cache_dir: Path = setting(default_cache_dir, "where the tiny model is built ($XDG_CACHE_HOME/dpserve)", UP)
    run_dir: Path | None = setting(None, "where replica logs go (none: a new temporary folder)", UP)
    replica_start_timeout_s: float = setting(
        900.0, "seconds to wait for each replica to start", UP, flag="--start-timeout"
    )
    cpu_kv_cache_gib: int = setting(1, "KV-cache GiB of each CPU replica (VLLM_CPU_KVCACHE_SPACE)", UP, minimum=1)
    tensor_parallel_size: int = setting(
        1,
        "GPUs per replica, vLLM's flag of the same name: the GPUs are grouped K at a time, each group as close as "
        "NVML's topology allows (NVLink, then one PCIe switch, ...); K must divide the GPU count. On the CPU: K "
        "ranks per replica, a core set each",
        UP,
        metavar="K",
        minimum=1,
    )
    max_model_len: int | None = setting(
        None, "context length of every replica (none: the model's own, as `vllm serve` chooses)", UP, minimum=1
    )
    vllm_args: tuple[str, ...] = setting(
        (), "flags for every `vllm serve` replica, given after `--`", UP, flag=None, env="DPSERVE_VLLM_ARGS"
    )
    sim_replicas: int = setting(
        0,
        "start N simulator replicas (dpserve sim) instead of vLLM",
        UP,
        flag="--sim",
        env="DPSERVE_SIM_REPLICAS",  # as it was: DPSERVE_SIM_ names the simulator's own settings
        metavar="N",
    )
    routers: int = setting(
        1,
        "routers on --port, --port+1, ..., each a --peer of the others, sharing routing state",
        UP,
        metavar="N",
        minimum=1,
    )
    engine_dp: bool = setting(
        False,
        "one vLLM server per host with --data-parallel-size = the replica count (its GPUs; on CPU one core set "
        "per engine), the router routing to each engine (X-data-parallel-rank); without it, one server per GPU",
        UP,
    )
    replica_key: bool = setting(
        True,
        "vLLM replicas answer only their routers: each run starts them with a new key (or --replica-api-key's) "
        "that only its routers are given; --no-replica-key: replicas open to any local process (benchmarks and "
        "tests that call them directly)",
        UP,
        flag="--no-replica-key",
        form=Form.OFF_SWITCH,
    )
    enable_lora: bool = setting(
        False,
        "start replicas with LoRA (implied by --lora or --lora-dir); adapters are loaded at run time",
        ENGINE_LORA,
    )
    max_loras: int = setting(DEFAULT_MAX_LORAS, "adapters per batch per replica", ENGINE_LORA, minimum=1)
    max_lora_rank: int = setting(DEFAULT_MAX_LORA_RANK, "highest adapter rank replicas accept", ENGINE_LORA, minimum=1)

    def __post_init__(self) -> None:
        check_lora_engine(self.max_loras, self.max_lora_rank)
        low, high = self.min_replicas, self.max_replicas
        if low is not None and high is not None and low > high:
            raise ValueError(f"--min-replicas {low} is more than --max-replicas {high}")
        check_tensor_parallel_size(self.tensor_parallel_size)

    @property
    def elastic(self) -> bool:
        """Replicas start and stop with the load: a range of replica counts, not one."""
        return self.max_replicas is not None and self.fewest_replicas < self.max_replicas

    @property
    def fewest_replicas(self) -> int:
        """--min-replicas, 1 when only --max-replicas is given."""
        return self.min_replicas if self.min_replicas is not None else 1

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.router.lora or self.router.lora_dir)


SIM = "simulated replica"
SIM_MODEL = "simulated engine"


@dataclass(frozen=True)
class SimSettings:
    """`dpserve sim`: one simulated vLLM replica. Its engine's flags are named as vLLM's where vLLM has them
    (--block-size, --max-num-seqs), and read from `DPSERVE_SIM_<FLAG>`."""

    FLAG_SCOPE: ClassVar[str] = "sim_"

    host: str = setting("127.0.0.1", "address to bind", SIM)
    port: int = setting(8000, "port", SIM)
    model: str | None = setting(None, "served model name (none: dpserve-tiny)", SIM)
    served_model_name: str | None = setting(None, "name clients use for the model (none: --model)", SIM)
    max_model_len: int = setting(4096, "context length", SIM, minimum=1)
    access_log: bool = setting(False, "log every request", SIM)
    log_level: str = setting("info", "log level", SIM, choices=LOG_LEVELS)
    # Read from VLLM_API_KEY as vLLM reads it: a compose file gives a sim replica what it gives vLLM's.
    sim_api_key: str | None = setting(
        None,
        "key clients must send (Authorization: Bearer KEY) on /v1 paths, as vLLM's --api-key (none: open)",
        SIM,
        env="VLLM_API_KEY",
        metavar="KEY",
        secret=True,
    )
    # HTTPS as vLLM serves it (its flags), for the compose stack's --tls: the replicas' certificate and key.
    sim_ssl_certfile: Path | None = setting(
        None, "serve HTTPS only, with this certificate chain (PEM), as vLLM's --ssl-certfile", SIM, metavar="FILE"
    )
    sim_ssl_keyfile: Path | None = setting(
        None, "the certificate's private key (PEM), as vLLM's --ssl-keyfile", SIM, metavar="FILE"
    )
    sim_block_size: int = setting(16, "tokens per KV block", SIM_MODEL, minimum=1)
    sim_num_blocks: int = setting(8192, "KV-cache capacity in blocks", SIM_MODEL, minimum=1)
    sim_max_num_seqs: int = setting(256, "batch limit", SIM_MODEL, minimum=1)
    sim_prefill_ms_per_token: float = setting(0.1, "milliseconds per uncached prompt token", SIM_MODEL)
    sim_decode_ms_per_token: float = setting(10.0, "milliseconds per output token", SIM_MODEL)
    sim_batch_slowdown: float = setting(0.02, "extra time per other running request, as a fraction", SIM_MODEL)
    sim_jitter: float = setting(0.0, "relative random spread of every wait (0.1 = ±10%)", SIM_MODEL)
    sim_seed: int = setting(0, "seed for jitter and generated tokens", SIM_MODEL)
    sim_speed: float = setting(1.0, "time scale: 2 = twice as fast, 0 = no waits at all", SIM_MODEL)
    sim_startup_s: float = setting(
        0.0,
        "seconds before it listens, as vLLM loading its model: replicas that take a while to start (elastic "
        "fleets, `dpserve bench elastic`)",
        SIM_MODEL,
        minimum=0,
    )
    sim_tokenizer: str = setting("tiny", "the tiny model's BPE, or a fast hash", SIM_MODEL, choices=("tiny", "fast"))
    sim_scheduling_policy: str = setting(
        "fcfs",
        "the waiting queue's order, as vLLM's: arrival, or each request's `priority` field first (lower sooner)",
        SIM_MODEL,
        choices=SCHEDULING_POLICIES,
    )
    sim_kv_events: str | None = setting(
        None,
        "ZMQ endpoint to publish KV events on, e.g. tcp://*:5557; engine R on port + R, as vLLM (none: no events)",
        SIM_MODEL,
        metavar="ENDPOINT",
    )
    sim_data_parallel_size: int = setting(
        1,
        "engines behind this one server, as `vllm serve --data-parallel-size`: each with its own batch, KV cache "
        "(--num-blocks each) and metrics; requests pinned by the X-data-parallel-rank header, else to the least loaded",
        SIM_MODEL,
        metavar="N",
        minimum=1,
    )

    sim_count: int = setting(
        1,
        "independent replicas served by this one process, each with its own engine(s), KV cache, metrics and KV "
        "events: replica I on --port + I, its KV events on the --kv-events port + I x --data-parallel-size, its "
        "seed + I x --data-parallel-size (port 0: the OS picks each)",
        SIM,
        # A count of replicas is --replicas in every command; --count is its first name, still taken.
        flag="--replicas",
        env="DPSERVE_SIM_COUNT",  # DPSERVE_SIM_REPLICAS is `dpserve up --sim`'s
        metavar="N",
        minimum=1,
        old_flags=("--count",),
    )

    def __post_init__(self) -> None:
        if self.sim_data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size {self.sim_data_parallel_size}: must be at least 1")
        if self.sim_count < 1:
            raise ValueError(f"--count {self.sim_count}: must be at least 1")
        if self.port and self.port + self.sim_count - 1 > 65535:
            raise ValueError(f"--count {self.sim_count} from --port {self.port}: ports past 65535")
        if self.sim_ssl_keyfile is not None and self.sim_ssl_certfile is None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile (TLS on)")


AGENT = "GPU agent"


@dataclass(frozen=True)
class AgentSettings:
    """`dpserve agent`: one per GPU host, serving that host's NVML readings to routers elsewhere."""

    # All addresses by default, as DCGM's exporter: routers on other hosts read it. It serves readings only
    # (no prompts, no keys); keep port 9400 inside the cluster's network.
    host: str = setting("0.0.0.0", "address to bind (routers elsewhere read it)", AGENT)
    port: int = setting(9400, "port (as DCGM's exporter)", AGENT)
    interval_s: float = setting(1.0, "seconds between NVML readings", AGENT)
    hostname: str | None = setting(
        None, "the host name to report (none: this machine's; a Kubernetes node name)", AGENT
    )
    nvml: str | None = setting(
        None,
        "MODULE:CALLABLE returning a pynvml-like module, in place of pynvml (a GPU-less rehearsal)",
        AGENT,
        metavar="MODULE:CALLABLE",
        hidden=True,
    )
    access_log: bool = setting(False, "log every request", AGENT)
    log_level: str = setting("info", "log level", AGENT, choices=LOG_LEVELS)


class SettingError(ValueError):
    """A value a setting cannot take, or a config file that cannot be read: its text names where the value
    came from (the flag, the variable, the file and its key) and what is wrong with it."""


LARGEST_INT = 2**63 - 1
"""The most an integer setting may be unless it says otherwise: what C code below Python takes."""
LARGEST_FLOAT = 1e9
"""The most a number with a fraction may be unless it says otherwise: a billion seconds (31 years) is past any
wait, and below threading's TIMEOUT_MAX, which a longer wait overflows."""
LARGEST_PORT = 65535

# Each pydantic error type as the words that follow the value in a message.
PROBLEMS = {
    "int_parsing": "is not a whole number",
    "int_type": "is not a whole number",
    "int_from_float": "is not a whole number",
    "float_parsing": "is not a number",
    "float_type": "is not a number",
    "finite_number": "is not a finite number",
    "bool_parsing": "is not true or false (true, false, yes, no, on, off, 1, 0)",
    "bool_type": "is not true or false (true, false, yes, no, on, off, 1, 0)",
    "string_type": "is not text",
    "string_too_short": "is empty",
    "tuple_type": "is not a list",
    "path_type": "is not a path",
    "greater_than_equal": "must be at least {ge}",
    "less_than_equal": "must be at most {le}",
    "literal_error": "is not one of {expected}",
}


def _bounds(name: str, found: Setting, kind: type) -> tuple[float, float]:
    """The least and the most a number setting may be: its declared ones, else from 0 (no count, size, time
    or weight is negative) to a port's largest, or LARGEST_INT or LARGEST_FLOAT."""
    port = name == "port" or name.endswith("_port")
    least = found.minimum if found.minimum is not None else 0
    most = LARGEST_PORT if port else LARGEST_INT if kind is int else LARGEST_FLOAT
    return least, found.maximum if found.maximum is not None else most


@functools.cache
def type_hints(group: type[DataclassInstance]) -> dict[str, Any]:
    """`group`'s fields' type hints (evaluated once: a check reads them for each value)."""
    return get_type_hints(group)


def _optional(hint: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed too): `int | None` -> (int, True)."""
    args = get_args(hint)
    if type(None) in args:
        (inner,) = (arg for arg in args if arg is not type(None))
        return inner, True
    return hint, False


@functools.cache
def _validator(group: type[DataclassInstance], name: str, choices: tuple[str, ...] | None, bounded: bool) -> Any:
    """A pydantic TypeAdapter for setting `name` of `group`: its field's type hint, with its choices, and (when
    `bounded`) its bounds and no empty text. Imported here: only a command that loads settings pays for
    pydantic."""
    from pydantic import ConfigDict, Field, TypeAdapter

    found = dict(settings_of(group))[name]
    inner, optional = _optional(type_hints(group)[name])
    checked: Any = inner
    if inner in (int, float) and bounded:
        least, most = _bounds(name, found, inner)
        # No NaN or infinity for a float (an int has neither; the option is only a float's).
        finite = False if inner is float else None
        checked = Annotated[inner, Field(ge=least, le=most, allow_inf_nan=finite)]
    elif inner is str:
        allowed = choices or found.choices
        text = Annotated[str, Field(min_length=1)] if bounded else str
        checked = Literal[allowed] if allowed else text
    elif get_origin(inner) is tuple and bounded:
        checked = tuple[Annotated[str, Field(min_length=1)], ...]
    if optional:
        checked = Optional[checked]  # noqa: UP045  # a type built at run time: `X | None` needs a class
    # YAML reads `api-key: 12345` as a number and `gpu-ignored-xids: [13]` as numbers: text settings take them.
    return TypeAdapter(checked, config=ConfigDict(coerce_numbers_to_str=True))


def check_setting(
    group: type[DataclassInstance],
    name: str,
    value: Any,
    where: str,
    choices: tuple[str, ...] | None = None,
    *,
    bounded: bool = True,
) -> Any:
    """`value` as setting `name` of `group` holds it (text parsed: `'8000'` -> 8000); a SettingError
    `WHERE: VALUE PROBLEM` when it cannot be (`DPSERVE_PORT: 'abc' is not a whole number`)."""
    from pydantic import ValidationError

    inner, _ = _optional(type_hints(group)[name])
    if isinstance(value, bool) and inner in (int, float):  # pydantic reads true as 1
        raise SettingError(f"{where}: {value!r} is not a number")
    if bounded and inner is Path and isinstance(value, str) and not value.strip():  # pydantic reads "" as "."
        raise SettingError(f"{where}: {value!r} is empty")
    try:
        return _validator(group, name, choices, bounded).validate_python(value)
    except ValidationError as exc:
        raise SettingError(f"{where}: {_problem(value, exc.errors()[0])}") from None


def _problem(value: Any, error: Any) -> str:
    """A pydantic error in words: the value (a list's item where it is the item) and what is wrong with it."""
    location = [step for step in error["loc"] if isinstance(step, int)]
    if location and isinstance(value, (list, tuple)):
        return f"item {location[0] + 1}, " + _problem(value[location[0]], {**error, "loc": ()})
    context = dict(error.get("ctx") or {})
    words = PROBLEMS.get(error["type"])
    if words is None:
        return f"{value!r}: {error['msg']}"
    shown = {key: int(item) if isinstance(item, float) and item.is_integer() else item for key, item in context.items()}
    return f"{value!r} {words.format(**shown)}"


@dataclass(frozen=True)
class ConfigFile:
    """`--config FILE`: settings in YAML, keyed by their flags' names (`max-model-len: 8192`, or
    `max_model_len`), a repeated flag's items as a list; relative paths are read from the file's folder."""

    path: Path
    entries: Mapping[str, tuple[str, Any]]
    """{key as written, dashes for underscores: (key as written, value)}."""

    @classmethod
    def read(cls, path: Path | str) -> ConfigFile:
        """The file's entries; a SettingError naming the file when it cannot be read or is no YAML mapping."""
        import yaml

        path = Path(path)
        where = f"--config {path}"
        try:
            loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_unique_keys_loader())  # a SafeLoader
        except OSError as exc:
            raise SettingError(f"{where}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise SettingError(f"{where}: not text (UTF-8)") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise SettingError(f"{where}: not valid YAML{at}: {problem}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise SettingError(
                f"{where}: expected flag names and their values (max-model-len: 8192), not a {type(loaded).__name__}"
            )
        entries: dict[str, tuple[str, Any]] = {}
        for key, value in loaded.items():
            written = key if isinstance(key, str) else json.dumps(key, default=str)  # `null`, as YAML wrote it
            spelled = written.replace("_", "-")
            if spelled in entries:
                raise SettingError(f"{where}: {written} and {entries[spelled][0]} are the same setting, given twice")
            entries[spelled] = (written, value)
        return cls(path, entries)

    def check_keys(self, group: type[DataclassInstance]) -> None:
        """A SettingError for a key `group`'s command does not take, with the closest one it does."""
        taken = file_keys(group)
        for spelled, (written, _) in self.entries.items():
            if spelled in taken:
                continue
            if spelled in file_keys(group, router_only=True):
                raise SettingError(f"--config {self.path}: {written} is `dpserve router`'s only (this command sets it)")
            close = difflib.get_close_matches(spelled, list(taken), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise SettingError(f"--config {self.path}: {written} is no setting of this command{hint}")

    def value(self, group: type[DataclassInstance], name: str, choices: tuple[str, ...] | None) -> tuple[bool, Any]:
        """(whether the file gives setting `name` of `group`, its value, checked)."""
        found = dict(settings_of(group))[name]
        for spelled in _keys_of(name, found):
            if spelled not in self.entries:
                continue
            written, raw = self.entries[spelled]
            where = f"--config {self.path}: {written}"
            if found.form in (Form.REPEAT, Form.LIST) and isinstance(raw, str):
                raw = split_list(raw) if found.form is Form.LIST else (raw,)  # as the flag given once
            checked = check_setting(group, name, raw, where, choices)
            if found.form is Form.OFF_SWITCH:
                checked = not checked  # `no-gpu-health: true`, as the flag
            if isinstance(checked, Path) and not checked.is_absolute():
                checked = self.path.parent / checked
            return True, checked
        return False, None


@functools.cache
def _unique_keys_loader() -> Any:
    """YAML's safe loader, refusing a key given twice (which it would else read as the last one given)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):  # type: ignore[misc]  # yaml ships no types
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    given = key in seen
                except TypeError:  # a list or a mapping as a key: the loader says so below
                    continue
                if given:
                    raise yaml.constructor.ConstructorError(None, None, f"{key} is given twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeys


def _keys_of(name: str, found: Setting) -> tuple[str, ...]:
    """A setting's keys in a config file: its flag's names less `--` (its field's name, dashed, where it has no
    flag: `vllm-args`)."""
    if found.flag is None:
        return (name.replace("_", "-"),)
    return tuple(flag.removeprefix("--") for flag in (found.flag, *found.old_flags))


@functools.cache
def file_keys(group: type[DataclassInstance], router_only: bool = False) -> dict[str, str]:
    """{config file key: field name} of `group`'s command, groups within it included (`dpserve up`: its own
    and the router's, less those only `dpserve router` takes; `router_only`: those alone)."""
    keys: dict[str, str] = {}
    hints = type_hints(group)
    for name, found in settings_of(group):
        if not router_only:
            keys.update(dict.fromkeys(_keys_of(name, found), name))
    for f in fields(group):
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name]):
            keys.update(_nested_keys(hints[f.name], router_only))
    return keys


def _nested_keys(group: type[DataclassInstance], router_only: bool) -> dict[str, str]:
    return {
        key: name
        for name, found in settings_of(group)
        if found.router_only == router_only
        for key in _keys_of(name, found)
    }


def load_settings(
    group: type[S],
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config: ConfigFile | None = None,
    choices: Mapping[str, tuple[str, ...]] | None = None,
) -> S:
    """`group` from flags (`overrides`, by field name; `None` is unset and names of other groups are
    ignored) over a config file over environment variables over the defaults, each value checked against its
    setting's type and bounds (`choices`: more, by field name, from modules above this one). A group inside a
    group (`UpSettings.router`) is loaded from the same flags, file and environment. A SettingError (a
    ValueError) names the flag, variable or file key whose value is wrong; the group's own checks raise
    ValueErrors too."""
    env = os.environ if env is None else env
    overrides = overrides or {}
    choices = choices or {}
    hints = type_hints(group)
    declared = dict(settings_of(group))
    values: dict[str, Any] = {}
    for f in fields(group):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            values[f.name] = load_settings(hint, overrides, env, config, choices)
            continue
        found = declared.get(f.name)
        if found is None:  # no user setting (`peer_siblings`)
            if overrides.get(f.name) is not None:
                values[f.name] = overrides[f.name]
            continue
        allowed = choices.get(f.name)
        variable, raw = _from_environment(found, env)
        if variable is not None and raw is not None:
            text = tuple(raw.replace(found.separator, " ").split()) if get_origin(hint) is tuple else raw
            values[f.name] = check_setting(group, f.name, text, variable, allowed)
        given, value = config.value(group, f.name, allowed) if config is not None else (False, None)
        if given:
            values[f.name] = value
        if overrides.get(f.name) is not None:
            values[f.name] = check_setting(group, f.name, overrides[f.name], found.flag or f.name, allowed)
    return group(**values)


def _from_environment(found: Setting, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(the variable read, its text); an empty variable is unset. An old name warns, and loses to the new one."""
    for variable in (found.env, *found.aliases):
        raw = env.get(variable) if variable is not None else None
        if variable is not None and raw:
            if variable != found.env:
                log.warning("%s is deprecated: use %s (or %s)", variable, found.env, found.flag)
            return variable, raw
    return None, None


def environment_names() -> dict[str, str]:
    """Every variable a setting is read from, old names included: {variable: the variable to use}."""
    names: dict[str, str] = {}
    for group in (RouterSettings, UpSettings, SimSettings, AgentSettings):
        for _, found in settings_of(group):
            if found.env is not None:
                names[found.env] = found.env
                names.update(dict.fromkeys(found.aliases, found.env))
    return names


NOT_SETTINGS = frozenset(
    {
        "DPSERVE_FAKE_NVML_FILE",
        "DPSERVE_SAVE_MULTI_HOST_STATUS",
        "DPSERVE_GPU_STATUS_OUT",
        "DPSERVE_PURE_PYTHON",
        "DPSERVE_COMPILE",
        "DPSERVE_BUILD",
    }
)
"""`DPSERVE_` variables that are no settings: the tests' own (tests/fake_nvml.py, tests/gpu/,
tests/integration/test_multi_host.py) and the build's, which `make test` exports to every process it starts
(DPSERVE_PURE_PYTHON is read on import by dpserve/__init__.py, DPSERVE_COMPILE by setup.py, DPSERVE_BUILD by
the suite)."""


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """A line for each `DPSERVE_` variable no setting reads (a misspelling would else be ignored without a
    word), with the closest known name when one is close."""
    known = environment_names()
    lines = []
    for variable in sorted(env):
        if not variable.startswith(ENV_PREFIX) or variable in known or variable in NOT_SETTINGS:
            continue
        # Compared without the prefix every name shares, which would make any two look close.
        bare = {name.removeprefix(ENV_PREFIX): name for name in known}
        close = difflib.get_close_matches(variable.removeprefix(ENV_PREFIX), list(bare), n=1)
        hint = f": did you mean {known[bare[close[0]]]}?" if close else ""
        lines.append(f"{variable} is set, but no dpserve setting reads it{hint}")
    return lines


def split_list(text: str) -> tuple[str, ...]:
    """`a,b c` -> ("a", "b", "c"): how a list setting is written in a flag or an environment variable."""
    return tuple(text.replace(",", " ").split())


TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
"""What a yes-or-no request header reads as true."""


def settings_argv(settings: DataclassInstance, skip: frozenset[str] = frozenset()) -> list[str]:
    """The flags that give `settings` where they differ from the defaults (secrets and `skip` left out): the
    command line `dpserve up` starts its router with, and the router containers' (`dpserve compose`, `kube`)."""
    defaults = type(settings)()
    argv: list[str] = []
    for name, found in settings_of(type(settings)):
        value = getattr(settings, name)
        if found.flag is None or found.secret or name in skip or value == getattr(defaults, name):
            continue
        argv += _flag_argv(found, value)
    return argv


def _flag_argv(found: Setting, value: Any) -> list[str]:
    assert found.flag is not None
    if found.form is Form.REPEAT:
        return [part for item in value for part in (found.flag, str(item))]
    if found.form is Form.LIST:
        return [found.flag, ",".join(value)]
    if found.form in (Form.SWITCH, Form.OFF_SWITCH):
        return [found.flag]  # either way, the one value that differs from the default
    if found.form is Form.ON_OFF:
        return [found.flag, "on" if value else "off"]
    return [found.flag, str(value)]
