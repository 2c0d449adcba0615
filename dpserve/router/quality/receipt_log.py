"""`--receipts-log PATH`: every receipt, once its answer is done, as one JSON line appended to a file.

Buffered: a line costs a copy into memory, and the file is written when the buffer fills or a second after
the last write to it (so `tail -f` follows along), and at shutdown. The file only grows; rotate it with
`logrotate`'s copytruncate, or read it with `dpserve tune --receipts`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import orjson

from dpserve.router.quality.receipts import Receipt

FLUSH_AFTER_S = 1.0


class ReceiptLog:
    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path).expanduser()
        try:
            self._file: BinaryIO = open(self.path, "ab")  # held open for the router's life
        except OSError as exc:
            raise ValueError(f"--receipts-log {path}: {exc.strerror or exc}") from None
        self._clock = clock
        self._flushed_at = clock()
        self.written = 0

    def write(self, receipt: Receipt) -> None:
        self._file.write(orjson.dumps(receipt.to_dict(keys=True)) + b"\n")
        self.written += 1
        now = self._clock()
        if now - self._flushed_at >= FLUSH_AFTER_S:
            self._file.flush()
            self._flushed_at = now

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()
