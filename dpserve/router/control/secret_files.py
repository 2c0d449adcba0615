"""Secrets given as files, applied again when a file changes, without a restart.

Every secret the router holds can come from a file: client and admin keys (`--api-key-file`,
`--admin-key-file`), tenant rules (`--tenant-file`), the replicas' key (`--replica-api-key-file`), and the TLS
files (the router's certificate and key, the CA its clients and peers are verified against, its client
certificate to replicas). One task looks at each file every `--secret-check-interval` seconds: a change of its
inode, size or modification time (what a Kubernetes Secret's atomic swap of its `..data` link, an editor's save,
or `cp` makes) re-reads every file of that secret and puts the result in force for the next request or
connection; one in flight goes on as it started. A file that is missing, unreadable or wrong keeps the secret in
force and says why once (a log line and `dpserve_secret_reloads_total{result="failed"}`): a half-written file is
never taken for "no key".
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from dpserve.background import cancel_and_wait

log = logging.getLogger("dpserve.secrets")

Signature = tuple[int, int, int, int] | None
"""(device, inode, size, modification time in ns) of a file, None when it cannot be read."""


def signature(path: Path) -> Signature:
    try:
        found = os.stat(path)  # follows links: a swapped `..data` link is a new inode
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns


@dataclass
class Secret:
    """One secret and its files: `apply` reads them all again and puts the result in force (a ValueError or
    OSError keeps the one in force)."""

    name: str
    """The flag it is given by, for logs and metrics (`--api-key-file`)."""
    paths: Sequence[Path]
    apply: Callable[[], None]
    seen: tuple[Signature, ...] = field(default=(), init=False)
    applied: int = field(default=0, init=False)
    failed: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.seen = self._signatures()

    def _signatures(self) -> tuple[Signature, ...]:
        return tuple(signature(path) for path in self.paths)

    def check(self) -> bool | None:
        """Applies the files again when one changed: True when applied, False when that failed, None when
        nothing changed."""
        now = self._signatures()
        if now == self.seen:
            return None
        self.seen = now
        try:
            self.apply()
        except (ValueError, OSError) as exc:
            self.failed += 1
            log.error("%s changed but cannot be used; the one read before stays in force: %s", self.name, exc)
            return False
        self.applied += 1
        log.info("%s changed: in force from now on", self.name)
        return True


class SecretFiles(Collector):
    """Watches the secrets' files; starts and stops itself."""

    def __init__(self, secrets: Sequence[Secret], interval_s: float) -> None:
        self.secrets = [secret for secret in secrets if secret.paths]
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def check(self) -> list[str]:
        """One look at every file; the names of the secrets applied again."""
        return [secret.name for secret in self.secrets if secret.check()]

    def start(self) -> None:
        if self.secrets and self.interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "dpserve_secret_reloads",
            "Secrets read again from their files after a change (--api-key-file, --replica-api-key-file, TLS "
            "files, ...): applied, or failed (the one read before stays in force).",
            labels=["secret", "result"],
        )
        for secret in self.secrets:
            family.add_metric([secret.name, "applied"], secret.applied)
            family.add_metric([secret.name, "failed"], secret.failed)
        yield family
