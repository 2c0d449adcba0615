"""Who may call what: API keys, the admin key, limits on request headers, and the bind rule.

Paths fall in three classes. Probes and metrics are public (load balancers and Prometheus call them
without keys). The OpenAI API needs a user key (an admin key works too). The admin API, and /status
and /dashboard (which show replica URLs), need an admin key. With no key configured at all, every
path is open, which is why the router then refuses to listen beyond loopback unless told --insecure.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from dpserve.config import RouterSettings
from dpserve.router.flow.tenants import CALLER_SCOPE_KEY, Caller, split_named_key
from dpserve.router.http.errors import OpenAIError

PUBLIC_PATHS = frozenset({"/health", "/ready"})
METRICS_PATH = "/metrics"
ADMIN_PATHS = frozenset({"/status", "/dashboard"})
ADMIN_PREFIX = "/admin/"


class Access(Enum):
    PUBLIC = "public"
    METRICS = "metrics"
    """Open, unless metrics keys are given (`--metrics-key-file`): then one of them or an admin key."""
    USER = "user"
    ADMIN = "admin"


def required_access(path: str) -> Access:
    if path in PUBLIC_PATHS:
        return Access.PUBLIC
    if path == METRICS_PATH:
        return Access.METRICS
    if path in ADMIN_PATHS or path.startswith(ADMIN_PREFIX) or path == ADMIN_PREFIX.rstrip("/"):
        return Access.ADMIN
    return Access.USER


ADMIN_TENANT = "admin"
"""The tenant of requests made with an admin key that has no name of its own."""


@dataclass(frozen=True)
class Keys:
    users: tuple[bytes, ...] = field(default=(), repr=False)
    admins: tuple[bytes, ...] = field(default=(), repr=False)
    user_names: tuple[str, ...] = ()
    """The tenant of each user key, in the same order (`NAME:KEY`, or a hash of a bare key)."""
    metrics: tuple[bytes, ...] = field(default=(), repr=False)
    """Keys that read /metrics and nothing else."""
    _mac: hashlib.blake2b = field(init=False, repr=False, compare=False)
    _by_mac: dict[bytes, tuple[bool, int]] = field(init=False, repr=False, compare=False)
    _metrics_macs: frozenset[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Keys are found by a keyed hash (BLAKE2b under a secret drawn at start), not compared byte by byte:
        # a guess's MAC is unpredictable without the secret, so how long the table's lookup takes says nothing
        # about how close the guess is to a key, nor about any key's length. One MAC per request, whatever
        # the number of keys (a loop of compare_digest costs ~130 ns per key: 5.5 us at 100 keys; this ~0.4 us).
        mac = hashlib.blake2b(key=secrets.token_bytes(32), digest_size=32)
        by_mac = {_mac_of(mac, key): (False, index) for index, key in enumerate(self.users)}
        by_mac.update({_mac_of(mac, key): (True, index) for index, key in enumerate(self.admins)})
        metrics_macs = frozenset(_mac_of(mac, key) for key in self.metrics)
        object.__setattr__(self, "_metrics_macs", metrics_macs)
        object.__setattr__(self, "_mac", mac)
        object.__setattr__(self, "_by_mac", by_mac)

    @property
    def enabled(self) -> bool:
        return bool(self.users or self.admins)

    def name_of(self, index: int) -> str:
        return self.user_names[index] if index < len(self.user_names) else f"key-{index}"

    def reads_metrics(self, token: bytes) -> bool:
        """A metrics key or an admin key."""
        found = _mac_of(self._mac, token)
        return found in self._metrics_macs or self._by_mac.get(found, (False, 0))[0]

    def find(self, token: bytes) -> tuple[bool, int] | None:
        """(is an admin key, its index among the user or admin keys) of the key `token` is, or None."""
        return self._by_mac.get(_mac_of(self._mac, token))


class KeyRing:
    """The keys in force, read by every request; replaced whole when a key file changes
    (control/secret_files.py), so a request sees either the old keys or the new ones."""

    __slots__ = ("keys",)

    def __init__(self, keys: Keys) -> None:
        self.keys = keys


def _mac_of(mac: hashlib.blake2b, token: bytes) -> bytes:
    copy = mac.copy()  # the keyed state, without re-keying (a third cheaper than a new keyed hash)
    copy.update(token)
    return copy.digest()


def read_key_file(path: Path) -> list[str]:
    """One key per line; blank lines and `#` comments are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read key file {path}: {exc.strerror}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"key file {path} has no key in it")
    return keys


def load_keys(settings: RouterSettings) -> Keys:
    """User keys may be named (`NAME:KEY`, in flags, files and DPSERVE_API_KEYS alike): NAME is their
    tenant. Admin keys are taken whole."""
    given = list(settings.api_keys) + (read_key_file(settings.api_key_file) if settings.api_key_file else [])
    named = [split_named_key(text) for text in given]
    admins = list(settings.admin_keys) + (read_key_file(settings.admin_key_file) if settings.admin_key_file else [])
    metrics = read_key_file(settings.metrics_key_file) if settings.metrics_key_file else []
    for key in [key for _, key in named] + admins + metrics:
        if len(key) < 8 or any(ch.isspace() for ch in key):
            raise ValueError("API, admin and metrics keys need at least 8 characters and no whitespace")
    return Keys(
        tuple(key.encode() for _, key in named),
        tuple(key.encode() for key in admins),
        tuple(name for name, _ in named),
        tuple(key.encode() for key in metrics),
    )


def check_bind(host: str, keys: Keys, insecure: bool) -> None:
    """Raises ValueError when the router would serve without keys beyond this machine."""
    if keys.enabled or insecure or is_loopback(host):
        return
    raise ValueError(
        f"refusing to listen on {host} without API keys: give --api-key (or --api-key-file), "
        "bind 127.0.0.1, or pass --insecure to serve anyone who can reach it"
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authorize(keys: Keys, access: Access, authorization: bytes | None) -> OpenAIError | Caller | None:
    """The caller (its key's tenant) when the request may go on, None when no key is needed, else the error
    to answer with."""
    if access is Access.METRICS:
        return _metrics_access(keys, authorization)
    if access is Access.PUBLIC or not keys.enabled:
        return None
    token = _bearer(authorization)
    found = keys.find(token) if token is not None else None
    if found is None:
        message = (
            "Missing API key: send `Authorization: Bearer YOUR_KEY`." if token is None else "Invalid API key provided."
        )
        return OpenAIError(401, message, code="invalid_api_key", headers={"www-authenticate": 'Bearer realm="dpserve"'})
    admin, index = found
    if access is Access.ADMIN and not admin:
        return OpenAIError(403, "This path needs an admin key.", type="permission_error", code="admin_key_required")
    # An admin key is trusted to name the tenant it acts for.
    return Caller(ADMIN_TENANT, True) if admin else Caller(keys.name_of(index), False)


def _metrics_access(keys: Keys, authorization: bytes | None) -> OpenAIError | None:
    if not keys.metrics:
        return None
    token = _bearer(authorization)
    if token is not None and keys.reads_metrics(token):
        return None
    message = "/metrics needs a metrics key (or an admin key): send `Authorization: Bearer KEY`."
    return OpenAIError(401, message, code="invalid_api_key", headers={"www-authenticate": 'Bearer realm="dpserve"'})


def _bearer(authorization: bytes | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


class Guard:
    """ASGI middleware in front of everything: header size limit, then the key check. Pure ASGI (no
    BaseHTTPMiddleware) so streams pass through untouched and the hot path pays one loop over headers."""

    def __init__(self, app: ASGIApp, ring: KeyRing, max_header_bytes: int) -> None:
        self.app = app
        self.ring = ring
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = 0
        authorization = None
        for name, value in scope["headers"]:
            size += len(name) + len(value)
            if name == b"authorization":
                authorization = value
        error: OpenAIError | Caller | None
        if size > self.max_header_bytes:
            error = OpenAIError(
                431,
                f"Request headers total {size} bytes, over this router's limit of {self.max_header_bytes}.",
                code="headers_too_large",
            )
        else:
            error = authorize(self.ring.keys, required_access(scope["path"]), authorization)
        if not isinstance(error, OpenAIError):
            if error is not None:
                scope[CALLER_SCOPE_KEY] = error
            await self.app(scope, receive, send)
            return
        await error.to_response({"connection": "close"} if error.status == 431 else None)(scope, receive, send)
