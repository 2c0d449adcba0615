"""A real PostgreSQL server for a test (Debian's, which `make test` installs): a cluster of its own in a
temporary folder, on a free loopback port, trusting local connections, removed when the block ends."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

START_TIMEOUT_S = 30


def server_binaries() -> Path | None:
    """The newest installed PostgreSQL's bin folder (/usr/lib/postgresql/N/bin), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda path: int(Path(path).parts[-3]))
    return Path(found[-1]).parent if found else None


@contextlib.contextmanager
def running_postgres() -> Iterator[str]:
    """Yields the server's URL (postgresql://postgres@127.0.0.1:PORT/postgres)."""
    binaries = server_binaries()
    if binaries is None:
        pytest.fail("PostgreSQL is not installed (make test installs Debian's postgresql)")
    # PostgreSQL refuses to run as root: as root, the cluster is the `postgres` user's (the package makes it).
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    work = Path(tempfile.mkdtemp(prefix="dpserve-pg-"))
    data, sockets = work / "data", work / "sockets"
    sockets.mkdir()
    if as_user:
        shutil.chown(work, "postgres")
        shutil.chown(sockets, "postgres")
    port = free_port()
    initdb = [*as_user, str(binaries / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]
    subprocess.run(initdb, check=True, capture_output=True)
    server = [*as_user, str(binaries / "postgres"), "-D", str(data), "-k", str(sockets), "-p", str(port)]
    server += ["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]
    log = (work / "server.log").open("wb")
    process = subprocess.Popen(server, stdout=log, stderr=subprocess.STDOUT)
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _accepts(binaries, port):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"PostgreSQL did not start:\n{(work / 'server.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(20)
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def _accepts(binaries: Path, port: int) -> bool:
    ready = subprocess.run([str(binaries / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)], capture_output=True)
    return ready.returncode == 0
