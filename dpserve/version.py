"""The package's version, declared once, in pyproject.toml: what `dpserve --version` says and what the images
built here (compose files, Kubernetes manifests) are tagged with."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
"""A checkout's pyproject.toml, beside the package directory (absent where the package is installed)."""


def package_version() -> str:
    """The installed distribution's version; in a checkout that was never installed, its pyproject.toml's."""
    try:
        return importlib.metadata.version("dpserve")
    except importlib.metadata.PackageNotFoundError:
        return checkout_version() or "unknown"


def checkout_version() -> str | None:
    """pyproject.toml's version where this package runs from a checkout, else None."""
    try:
        project = tomllib.loads(PYPROJECT.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None
    version = project.get("version")
    return version if isinstance(version, str) else None
