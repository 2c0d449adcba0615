"""`--lora-dir`: every subfolder is a LoRA adapter named after it, at the path the replicas see."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("dpserve.adapters")


class AdapterFolder:
    """The adapters in one folder, read at start and again (at most once a second) when a request names
    a model the router does not know: an adapter copied in later is served without a restart."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic, min_interval_s: float = 1.0) -> None:
        self.path = path
        self._clock = clock
        self._min_interval_s = min_interval_s
        self._last_read: float | None = None

    def read(self) -> dict[str, str]:
        """{name: path} of its subfolders (hidden ones aside); empty, with a warning, when it cannot be read."""
        self._last_read = self._clock()
        try:
            entries = sorted(os.scandir(self.path), key=lambda entry: entry.name)
        except OSError as exc:
            log.warning("cannot read the adapter folder %s: %s", self.path, exc)
            return {}
        return {
            entry.name: os.path.join(self.path, entry.name)
            for entry in entries
            if not entry.name.startswith(".") and entry.is_dir()
        }

    def reread(self) -> dict[str, str] | None:
        """`read()`, unless it was read less than a second ago (then None)."""
        if self._last_read is not None and self._clock() - self._last_read < self._min_interval_s:
            return None
        return self.read()
