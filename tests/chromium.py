"""Headless Chromium for page tests: Debian's `chromium` package, which `make test` installs."""

from __future__ import annotations

import pytest

from benchmarks.screenshot import find_chromium


def require_chromium() -> None:
    if find_chromium() is None:
        pytest.skip("Debian's chromium package is not installed (`make test` installs it)")
