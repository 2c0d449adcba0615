"""The compiled build: the hot-path modules pyproject.toml lists under [tool.dpserve] compiled, built with mypyc
from the same typed source, when DPSERVE_COMPILE=1 (`make compiled`, `make wheel`). Without it, or where no C
compiler is (the extensions are optional), the package is pure Python: an sdist installs anywhere."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent


def compiled_sources() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    sources: list[str] = pyproject["tool"]["dpserve"]["compiled"]
    return sources


def extensions() -> list[Extension]:
    if os.environ.get("DPSERVE_COMPILE") != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("DPSERVE_COMPILE=1 but mypyc is not installed: building pure Python", file=sys.stderr)
        return []
    # One shared library inside the package (not a hash-named module at the top of site-packages).
    built: list[Extension] = mypycify(compiled_sources(), opt_level="3", group_name="dpserve._compiled")
    for extension in built:
        extension.optional = True  # no compiler: the pure-Python modules stay
    return built


setup(ext_modules=extensions())
