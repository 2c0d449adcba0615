"""constraints.txt, the versions the images build from, against pyproject.toml's ranges; the upper bounds on
the libraries whose internals the router uses."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path
from types import ModuleType

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
RUNTIME = [Requirement(text) for text in [*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["cpu"]]]
INTERNALS_USED = {"uvicorn", "httptools"}
"""The router subclasses uvicorn's server and protocol and drives httptools' parser itself."""


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return pins


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("constraints_tool", ROOT / "tools" / "constraints.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_runtime_requirement_is_pinned_inside_its_range() -> None:
    pins = _pins()
    for requirement in RUNTIME:
        version = pins[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(version, prereleases=True), (str(requirement), str(version))


def test_internals_we_use_have_an_upper_bound() -> None:
    bounded = {
        canonicalize_name(r.name) for r in RUNTIME if any(spec.operator in ("<", "<=", "==") for spec in r.specifier)
    }
    assert bounded >= INTERNALS_USED


def test_the_images_build_from_the_constraints() -> None:
    # The router's within them; the CPU replica's exactly them (no resolving: what they list is what it gets).
    assert "pip install -c /src/constraints.txt" in (ROOT / "router" / "Dockerfile").read_text()
    assert "pip install --no-deps -r /deps/constraints.txt" in (ROOT / "replicas" / "Dockerfile.cpu").read_text()
    assert "constraints.txt" not in (ROOT / ".dockerignore").read_text()


def test_the_tool_follows_requirements_and_their_extras_through_installed_metadata() -> None:
    # This environment's own uvicorn[standard]: uvicorn, its plain requirements and the `standard` extra's.
    pinned, _ = _tool().closure([Requirement("uvicorn[standard]")])
    assert {"uvicorn", "click", "h11", "httptools", "websockets"} <= set(pinned)
    assert "uvloop" in pinned or sys.platform == "win32"
    plain, _ = _tool().closure([Requirement("uvicorn")])
    assert "httptools" not in plain
