"""Headless Chromium (Debian's `chromium` package, installed by `make test`) for page tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

# Chromium on a closed network: no background connections, no updates, a fresh profile per run.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Debian's chromium package is not installed (`make test` installs it)")
    return path


def run_chromium(profile: Path, *args: str, timeout_s: float = 60) -> str:
    command = [chromium(), *FLAGS, f"--user-data-dir={profile}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, f"chromium failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return done.stdout


def rendered_dom(url: str, profile: Path, wait_ms: int = 5000) -> str:
    """The page's DOM after its scripts ran for `wait_ms` of (virtual) time."""
    return run_chromium(profile, f"--virtual-time-budget={wait_ms}", "--dump-dom", url)


def screenshot(url: str, out: Path, profile: Path, size: tuple[int, int] = (1400, 900), wait_ms: int = 3000) -> Path:
    run_chromium(
        profile, f"--virtual-time-budget={wait_ms}", f"--window-size={size[0]},{size[1]}", f"--screenshot={out}", url
    )
    return out
