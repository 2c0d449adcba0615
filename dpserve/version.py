"""The package's version, declared once, in pyproject.toml: what `dpserve --version` says and what the images
built here (compose files, Kubernetes manifests) are tagged with."""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from importlib.machinery import EXTENSION_SUFFIXES
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


def compiled_sources() -> list[Path]:
    """The modules the compiled build compiles (pyproject.toml's [tool.dpserve] compiled): a checkout only."""
    try:
        sources = tomllib.loads(PYPROJECT.read_text())["tool"]["dpserve"]["compiled"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return []
    return [PYPROJECT.parent / source for source in sources]


def compiled_check() -> str | None:
    """None when every module of the compiled build has its extension beside it and the shared library that
    holds their code was built after every source; else what is missing or stale (a stale one would run code
    the source no longer says)."""
    sources = compiled_sources()
    library = [
        p for suffix in EXTENSION_SUFFIXES if (p := PYPROJECT.parent / f"dpserve/_compiled__mypyc{suffix}").exists()
    ]
    built_at = library[0].stat().st_mtime if library else 0.0
    wrong: list[str] = []
    for source in sources:
        name = source.relative_to(PYPROJECT.parent)
        if not any(source.with_suffix(suffix).exists() for suffix in EXTENSION_SUFFIXES):
            wrong.append(f"{name}: not compiled")
        elif source.stat().st_mtime > built_at:
            wrong.append(f"{name}: changed since it was compiled")
    return "; ".join(wrong) + " (make compiled)" if wrong else None


def running_compiled() -> list[str]:
    """The dpserve modules this process imported compiled, by name (none in the pure-Python build)."""
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if name.startswith("dpserve.")
        and not name.endswith("__mypyc")  # the library holding the compiled modules' code, not one of them
        and str(getattr(module, "__file__", "")).endswith(tuple(EXTENSION_SUFFIXES))
    )
