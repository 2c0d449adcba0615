"""Who a request is for and how urgent it is: tenants, their rules, and priority classes.

A tenant is an API key's name (`--api-key NAME:KEY`; a bare key is a tenant of its own, named by a hash
of it, never by the key), or the `x-dpserve-tenant` header when the key that sent it is trusted (with no
keys configured at all, every caller is). A tenant's rules (`--tenant NAME:weight=2,priority=batch,...`)
give its fair-share weight, its default and highest priority, and its quotas; `--tenant '*:...'` gives
the rules of every tenant without its own.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import IntEnum

from dpserve.router.flow.quotas import Quota
from dpserve.router.http.errors import OpenAIError, bad_request

CALLER_SCOPE_KEY = "dpserve.caller"
"""Where the key check (`access.Guard`) leaves the request's `Caller` in the ASGI scope."""
TENANT_HEADER = "x-dpserve-tenant"
PRIORITY_HEADER = "x-dpserve-priority"
ANONYMOUS = "anonymous"
"""The tenant of every request when no API key is configured and no header names one."""
DEFAULT_RULES = "*"
MADE_TENANTS = 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class Priority(IntEnum):
    """Lower is more urgent: admitted first. vLLM's own `priority` field orders the same way."""

    CRITICAL = 0
    STANDARD = 1
    BATCH = 2

    @property
    def label(self) -> str:
        return self.name.lower()


PRIORITIES = {p.label: p for p in Priority}


@dataclass(frozen=True)
class TenantRules:
    weight: float = 1.0
    """Share of the fleet against other tenants of the same class while it is saturated."""
    priority: Priority = Priority.STANDARD
    """When a request names none."""
    max_priority: Priority = Priority.CRITICAL
    """The most urgent class its requests may ask for; above it they are served at this one."""
    quota: Quota = field(default_factory=Quota)
    trusted: bool = False
    """Its key may name the tenant of each request (`x-dpserve-tenant`): a gateway in front, say."""
    slo_ttft_s: float | None = None
    """The time to first token its requests are promised when they name none (`x-slo-ttft-ms`)."""
    slo_tpot_s: float | None = None
    """The time per output token its requests are promised when they name none (`x-slo-tpot-ms`)."""
    slo_queue: bool = False
    """A request of its that no replica is predicted to meet in time is sent anyway (to the replica
    predicted nearest), not refused at once with 429."""


@dataclass(init=False)
class Caller:
    """What the key check found: the key's tenant name, and whether it may name another."""

    tenant: str
    trusted: bool

    def __init__(self, tenant: str, trusted: bool) -> None:
        # Written out: dataclass's __init__ is interpreted even when compiled (see policies.base.RequestFeatures).
        self.tenant = tenant
        self.trusted = trusted


@dataclass(frozen=True)
class Tenant:
    """One request's tenant, rules and class."""

    name: str
    rules: TenantRules
    priority: Priority


def is_tenant_name(text: str) -> bool:
    return _NAME.fullmatch(text) is not None


def key_tenant(key: str) -> str:
    """The name of a bare key's tenant: a short hash, so logs and metrics never show the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]


def split_named_key(text: str) -> tuple[str, str]:
    """`NAME:KEY` -> (NAME, KEY); a bare KEY -> (its hash name, KEY)."""
    name, sep, key = text.partition(":")
    if sep and is_tenant_name(name) and key:
        return name, key
    return key_tenant(text), text


def parse_tenant_rules(text: str) -> tuple[str, TenantRules]:
    """`NAME:weight=2,priority=batch,max-priority=standard,rpm=60,tpm=100000,concurrent=8,trusted=true,
    slo-ttft-ms=300,slo-tpot-ms=50,slo=queue|refuse`;
    NAME `*` for the rules of tenants without their own. ValueError says what is wrong."""
    name, _, spec = text.partition(":")
    if name != DEFAULT_RULES and not is_tenant_name(name):
        raise ValueError(f"--tenant {text!r}: a tenant name is 1-64 letters, digits, '.', '_' or '-' (or '*')")
    rules = TenantRules()
    quota = Quota()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("_", "-")
        value = value.strip()
        if not eq or not value:
            raise ValueError(f"--tenant {text!r}: expected KEY=VALUE, got {item!r}")
        try:
            if key == "weight":
                weight = float(value)
                if not 0 < weight <= 1000:
                    raise ValueError
                rules = replace(rules, weight=weight)
            elif key == "priority":
                rules = replace(rules, priority=PRIORITIES[value])
            elif key == "max-priority":
                rules = replace(rules, max_priority=PRIORITIES[value])
            elif key == "rpm":
                quota = replace(quota, requests_per_min=_count(value))
            elif key == "tpm":
                quota = replace(quota, tokens_per_min=_count(value))
            elif key == "concurrent":
                quota = replace(quota, concurrent=_count(value))
            elif key == "trusted":
                rules = replace(rules, trusted={"true": True, "1": True, "false": False, "0": False}[value])
            elif key == "slo-ttft-ms":
                rules = replace(rules, slo_ttft_s=_milliseconds(value))
            elif key == "slo-tpot-ms":
                rules = replace(rules, slo_tpot_s=_milliseconds(value))
            elif key == "slo":
                rules = replace(rules, slo_queue={"queue": True, "refuse": False}[value])
            else:
                raise ValueError(
                    f"--tenant {text!r}: unknown {key!r} (weight, priority, max-priority, rpm, tpm, concurrent, "
                    "trusted, slo-ttft-ms, slo-tpot-ms, slo)"
                )
        except (KeyError, ValueError) as exc:
            if exc.args and isinstance(exc.args[0], str) and exc.args[0].startswith("--tenant"):
                raise
            raise ValueError(f"--tenant {text!r}: bad value for {key}: {value!r}") from None
    if rules.priority < rules.max_priority:
        raise ValueError(f"--tenant {text!r}: its default priority is above its max-priority")
    return name, replace(rules, quota=quota)


def _milliseconds(value: str) -> float:
    """Seconds from a count of milliseconds: 1 ms to one hour."""
    number = float(value)
    if not 1 <= number <= 3_600_000:
        raise ValueError
    return number / 1000.0


def _count(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError
    return number


class Tenants:
    """The tenants' rules and the request-time question: whose request is this, at what priority."""

    def __init__(self, rules: Mapping[str, TenantRules], open_access: bool) -> None:
        """`open_access`: no API key is configured, so every caller is trusted to name its tenant."""
        self._rules = dict(rules)
        self._default = self._rules.pop(DEFAULT_RULES, TenantRules())
        self._open = open_access
        self.named = frozenset(self._rules)
        """Tenants with rules of their own: metrics label them by name, the rest as "other"."""
        # A request's Tenant is made once per name (and class), not per request: keys' names are bounded,
        # names from a trusted header are not (`MADE_TENANTS`).
        self._plain: dict[str, Tenant] = {}
        self._made: dict[tuple[str, Priority], Tenant] = {}

    @classmethod
    def from_specs(cls, specs: Iterable[str], key_names: Iterable[str], open_access: bool) -> Tenants:
        rules: dict[str, TenantRules] = {}
        for spec in specs:
            name, found = parse_tenant_rules(spec)
            if name in rules:
                raise ValueError(f"--tenant {name} is given twice")
            rules[name] = found
        for name in key_names:
            rules.setdefault(name, rules.get(DEFAULT_RULES, TenantRules()))
        return cls(rules, open_access)

    def rules(self, name: str) -> TenantRules:
        return self._rules.get(name, self._default)

    def identify(self, caller: Caller | None, headers: Mapping[str, str]) -> Tenant:
        """The request's tenant and class; OpenAIError (400/403) for a header it may not or cannot use."""
        name = caller.tenant if caller is not None else ANONYMOUS
        named = headers.get(TENANT_HEADER)
        asked = headers.get(PRIORITY_HEADER)
        if named is None and asked is None:  # the common case: the key's (or no key's) tenant, its class
            tenant = self._plain.get(name)
            if tenant is None:
                rules = self.rules(name)
                tenant = self._plain[name] = Tenant(name, rules, rules.priority)
            return tenant
        if named is not None:
            if not (self._open or (caller is not None and (caller.trusted or self.rules(name).trusted))):
                raise OpenAIError(
                    403,
                    f"This key may not name a tenant (`{TENANT_HEADER}`); its requests are its own tenant's.",
                    type="permission_error",
                    code="tenant_not_allowed",
                )
            if not is_tenant_name(named):
                raise bad_request(
                    f"`{TENANT_HEADER}` must be 1-64 letters, digits, '.', '_' or '-'.", param=TENANT_HEADER
                )
            name = named
        rules = self.rules(name)
        priority = rules.priority
        if asked is not None:
            found = PRIORITIES.get(asked.strip().lower())
            if found is None:
                raise bad_request(
                    f"`{PRIORITY_HEADER}` must be one of {', '.join(PRIORITIES)}; got {asked[:32]!r}.",
                    param=PRIORITY_HEADER,
                )
            # Above its ceiling a request is served at the ceiling, not refused.
            priority = max(found, rules.max_priority)
        made = self._made
        tenant = made.get((name, priority))
        if tenant is None:
            if len(made) >= MADE_TENANTS:  # names from a trusted header are unbounded: start again
                made.clear()
            tenant = made[(name, priority)] = Tenant(name, rules, priority)
        return tenant
