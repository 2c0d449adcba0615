"""`--lora-dir`: every subfolder is a LoRA adapter named after it, at the path the replicas see. The folder is
read by its watch, in a thread and on its own schedule, so that no lookup on the request path touches the
disk: an adapter copied in while the router runs is served from the watch's next read (within a second)."""

from __future__ import annotations

import asyncio
import logging
import os

from dpserve.background import cancel_and_wait
from dpserve.replicas.catalog import ModelCatalog

log = logging.getLogger("dpserve.adapters")

WATCH_INTERVAL_S = 1.0
"""How often the folder is read again: a new adapter is servable at most this long after it is copied in."""


class AdapterFolder:
    def __init__(self, path: str) -> None:
        self.path = path

    def read(self) -> dict[str, str]:
        """{name: path} of its subfolders (hidden ones aside); raises OSError when it cannot be read."""
        entries = sorted(os.scandir(self.path), key=lambda entry: entry.name)
        return {
            entry.name: os.path.join(self.path, entry.name)
            for entry in entries
            if not entry.name.startswith(".") and entry.is_dir()
        }


class AdapterFolderWatch:
    """Reads the folder every `interval_s` (and once before serving, `refresh`) and hands the catalog the
    adapters it finds; adapters are only ever added (one removed from the folder stays served until a restart,
    as before)."""

    def __init__(self, folder: AdapterFolder, catalog: ModelCatalog, interval_s: float = WATCH_INTERVAL_S) -> None:
        self._folder = folder
        self._catalog = catalog
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._unreadable = False
        """The last read failed: warned once, not every second, until it reads again."""

    async def refresh(self) -> list[str]:
        """Reads the folder now (in a thread); the names of the adapters that were new to the catalog."""
        try:
            found = await asyncio.to_thread(self._folder.read)
        except OSError as exc:
            if not self._unreadable:
                log.warning("cannot read the adapter folder %s: %s", self._folder.path, exc)
            self._unreadable = True
            return []
        self._unreadable = False
        new = self._catalog.add_adapters(found)
        if new:
            log.info("new adapters in %s: %s", self._folder.path, ", ".join(new))
        return new

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="adapter-folder-watch")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.refresh()
            except Exception:
                # The watch must live on: it is how adapters copied in later get served.
                log.exception("reading the adapter folder %s failed unexpectedly", self._folder.path)
