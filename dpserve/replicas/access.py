"""What the router shows its replicas: the key vLLM was started with (`--api-key`), and the TLS context for
`https://` replicas (the CA their certificates are verified against, the router's own client certificate).

One `ReplicaAccess` is built from the settings (`router/parts.py`) and given to every client that talks to
replicas: the hot path's pool takes its header line and context, the router's other calls (probes, LoRA loads,
tokenizing, engine operations) share the aiohttp session it makes. The key is never shown: not in `repr`, and
no cause this module writes names it.

vLLM guards every path under /v1 (and /v2, /inference, /cohere) with its key and answers 401 without it
(vllm/entrypoints/serve/middleware/authenticate.py); /health, /metrics and /tokenize stay open. The key is sent
on everything anyway: a replica behind a proxy may guard more."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

KEY_REFUSED = (
    "it refused the router's key (HTTP 401): start the router with the replica's vLLM --api-key "
    "(--replica-api-key-file, --replica-api-key or DPSERVE_REPLICA_API_KEY)"
)
"""Why a replica that answers 401 is misconfigured: vLLM's only 401 is its key check, so it is never the client's."""


@dataclass(frozen=True)
class ReplicaAccess:
    key: str | None = field(default=None, repr=False)
    tls: ssl.SSLContext | None = None
    """For https:// replicas; None: the system's CAs, no client certificate."""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    @property
    def header_lines(self) -> bytes:
        """The header, as the hot path's client writes it after the request's own (b"" without a key)."""
        return b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in self.headers.items())

    def ssl_context(self) -> ssl.SSLContext:
        return self.tls if self.tls is not None else ssl.create_default_context()

    def client_session(self) -> aiohttp.ClientSession:
        """The session of the router's own calls to replicas: the key on every request, the TLS context on
        every https:// connection. Peers and GPU agents have their own (they are not replicas)."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0, ssl=self.tls if self.tls is not None else True)
        return aiohttp.ClientSession(connector=connector, headers=self.headers)


def read_key_file(path: Path) -> str:
    """The key in a file: its first line that is not blank or a `#` comment. A ValueError without one."""
    for line in path.read_text().splitlines():
        text = line.strip()
        if text and not text.startswith("#"):
            return text
    raise ValueError(f"--replica-api-key-file {path}: no key in it")


def replica_key(key: str | None, key_file: Path | None) -> str | None:
    """The key from `--replica-api-key` or `--replica-api-key-file`: one of them, not both."""
    if key and key_file:
        raise ValueError("give the replicas' key once: --replica-api-key or --replica-api-key-file, not both")
    found = read_key_file(key_file) if key_file else key
    if found is not None and not (found.isascii() and found.isprintable() and " " not in found):
        raise ValueError("the replicas' key must be printable ASCII, without spaces")
    return found or None


def tls_context(ca_certs: Path | None, certfile: Path | None, keyfile: Path | None) -> ssl.SSLContext | None:
    """The context for https:// replicas: their certificates verified (against `ca_certs`, else the system's
    CAs) and their host name checked; the router's client certificate when one is given. None: nothing
    given, the default context serves."""
    if keyfile and not certfile:
        raise ValueError("--replica-ssl-keyfile needs --replica-ssl-certfile (the certificate it is the key of)")
    if not (ca_certs or certfile):
        return None
    context = ssl.create_default_context(cafile=str(ca_certs) if ca_certs else None)
    if certfile:
        context.load_cert_chain(str(certfile), str(keyfile) if keyfile else None)
    return context


def reload_tls(context: ssl.SSLContext, ca_certs: Path | None, certfile: Path | None, keyfile: Path | None) -> None:
    """Files that changed, loaded into a context in use: connections made from now on show the new certificate
    and trust the new CA (besides those trusted before: a CA bundle is rotated by adding the new CA first)."""
    # Loaded into a scratch context first: a certificate whose key does not match must not half-replace the pair.
    try:
        for target in (ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), context):
            if certfile is not None:
                target.load_cert_chain(str(certfile), str(keyfile) if keyfile else None)
            if ca_certs is not None:
                target.load_verify_locations(cafile=str(ca_certs))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{certfile or ca_certs}: {exc}") from None


def load_replica_access(
    key: str | None,
    key_file: Path | None,
    ca_certs: Path | None = None,
    certfile: Path | None = None,
    keyfile: Path | None = None,
) -> ReplicaAccess:
    """A ValueError names the flag that is wrong (a file missing or unreadable included)."""
    try:
        return ReplicaAccess(replica_key(key, key_file), tls_context(ca_certs, certfile, keyfile))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"keys and TLS to replicas: {exc}") from None


def tls_refusal(exc: BaseException) -> str | None:
    """Why TLS with a replica failed, when it did (the exception or one it came from is an SSL error): its
    certificate did not verify, or TLS with it failed otherwise (often: it wants a client certificate). None for
    any other failure."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        inner = _wrapped(current)
        if inner is not None and id(inner) not in seen:
            current = inner  # aiohttp's own error types wrap the ssl module's, which say more
            continue
        if isinstance(current, ssl.SSLCertVerificationError):
            detail = getattr(current, "verify_message", None) or getattr(current, "reason", None) or str(current)
            return f"its TLS certificate failed verification ({detail}): check --replica-ssl-ca-certs"
        if isinstance(current, ssl.SSLError):
            detail = getattr(current, "reason", None) or str(current)
            return f"TLS with it failed ({detail}): check --replica-ssl-certfile and --replica-ssl-keyfile"
        current = current.__cause__ or current.__context__
    return None


def _wrapped(exc: BaseException) -> BaseException | None:
    """aiohttp keeps the error it failed on as an attribute, not always as the cause."""
    inner = getattr(exc, "certificate_error", None) or getattr(exc, "os_error", None)
    return inner if isinstance(inner, BaseException) and inner is not exc else None
