"""pyproject.toml's dependencies against what dpserve/ imports: every library imported at module level is declared
(not merely brought in by another), a library imported only inside a function comes with the dependencies or an
extra, each runtime requirement has a lower bound, the floors the code needs are kept, and what is installed
here (where the tests ran) is inside every declared range."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dpserve"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
FLOORS = {
    # What the code needs, and why: the declared lower bound may not fall below it.
    "python-multipart": ("0.0.18", "imported as python_multipart (0.0.13's name); 0.0.18 fixes CVE-2024-53981"),
    "starlette": ("0.36.3", "the oldest fastapi 0.110 (the fastapi floor) installs with"),
    "fastapi": ("0.110", "0.110 is the oldest release tested"),
    "uvicorn": ("0.50", "the router's protocol keeps 0.50's connection state; on 0.49 every request got a 400"),
    "httptools": ("0.8", "what uvicorn[standard] 0.50 installs with"),
}


@dataclass(frozen=True)
class Imported:
    module: str  # the top-level import name
    where: str  # path:line
    deferred: bool  # inside a function: runs only where that function is called
    optional: bool  # inside `try: ... except ImportError`: the code runs without it


class _Imports(ast.NodeVisitor):
    """Third-party imports, with where they run; `if TYPE_CHECKING:` blocks never run and are skipped."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.found: list[Imported] = []
        self._functions = 0
        self._guards = 0

    def _add(self, node: ast.Import | ast.ImportFrom, name: str) -> None:
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in ("dpserve", "__future__"):
            return
        where = f"{self.label}:{node.lineno}"
        self.found.append(Imported(top, where, self._functions > 0, self._guards > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._add(node, node.module)

    def visit_If(self, node: ast.If) -> None:
        if ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        caught = {name for handler in node.handlers if handler.type for name in _names(handler.type)}
        guarded = bool(caught & {"ImportError", "ModuleNotFoundError"})
        self._guards += guarded
        for child in node.body:
            self.visit(child)
        self._guards -= guarded
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(child)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._functions += 1
        self.generic_visit(node)
        self._functions -= 1

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function


def _names(node: ast.expr) -> Iterator[str]:
    if isinstance(node, ast.Tuple):
        for item in node.elts:
            yield from _names(item)
    else:
        yield ast.unparse(node).rpartition(".")[2]


def third_party_imports(root: Path = PACKAGE) -> list[Imported]:
    found: list[Imported] = []
    for path in sorted(root.rglob("*.py")):
        visitor = _Imports(str(path.relative_to(ROOT)))
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        found += visitor.found
    return found


@functools.cache
def _providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every installed distribution's file list: once


def distributions(module: str) -> set[str]:
    """The installed distributions that provide import name `module` (a namespace package: several)."""
    names = _providers().get(module)
    assert names, f"{module} is imported by dpserve/ but not installed here: its distribution cannot be told"
    return {canonicalize_name(name) for name in names}


def _closure_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("constraints_tool", ROOT / "tools" / "constraints.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def declared(project: dict[str, Any]) -> set[str]:
    return {canonicalize_name(Requirement(text).name) for text in project["dependencies"]}


def reachable(project: dict[str, Any]) -> set[str]:
    """Everything the dependencies and every extra install here, through installed metadata."""
    texts = [*project["dependencies"], *(t for extra in project["optional-dependencies"].values() for t in extra)]
    pinned, absent = _closure_tool().closure([Requirement(text) for text in texts])
    return set(pinned) | absent


def undeclared_imports(project: dict[str, Any], found: list[Imported]) -> list[str]:
    direct, anywhere = declared(project), reachable(project)
    wrong = []
    for imported in found:
        if imported.optional:
            continue
        dists = distributions(imported.module)
        if imported.deferred and not dists & anywhere:
            wrong.append(f"{imported.where}: {imported.module} ({', '.join(sorted(dists))}) comes with no extra")
        elif not imported.deferred and not dists & direct:
            wrong.append(f"{imported.where}: {imported.module} ({', '.join(sorted(dists))}) is not a dependency")
    return wrong


def lower_bound(requirement: Requirement) -> Version | None:
    bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=", ">")]
    return max(bounds) if bounds else None


def floors_broken(project: dict[str, Any]) -> list[str]:
    requirements = {canonicalize_name(Requirement(t).name): Requirement(t) for t in project["dependencies"]}
    wrong = []
    for name, (floor, why) in FLOORS.items():
        bound = lower_bound(requirements[name]) if name in requirements else None
        if bound is None or bound < Version(floor):
            wrong.append(f"{name}: declared {requirements.get(name, 'nowhere')}, the code needs >={floor} ({why})")
    return wrong


@pytest.mark.engine
def test_every_library_dpserve_imports_is_declared() -> None:
    found = third_party_imports()
    assert {i.module for i in found if not i.deferred} >= {"starlette", "fastapi", "python_multipart"}
    assert not undeclared_imports(PROJECT, found), "\n".join(undeclared_imports(PROJECT, found))


def test_imports_are_told_apart_by_where_they_run() -> None:
    source = (
        "import os\nfrom typing import TYPE_CHECKING\nimport starlette.types\nfrom . import sibling\n"
        "if TYPE_CHECKING:\n    import _typeshed\nelse:\n    import orjson\n"
        "try:\n    import huggingface_hub\nexcept (OSError, ImportError):\n    import jinja2\n"
        "try:\n    import zmq\nexcept ValueError:\n    pass\n"
        "async def build():\n    from transformers import LlamaConfig\n"
    )
    visitor = _Imports("mod.py")
    visitor.visit(ast.parse(source))
    assert [(i.module, i.deferred, i.optional) for i in visitor.found] == [
        ("starlette", False, False),
        ("orjson", False, False),
        ("huggingface_hub", False, True),
        ("jinja2", False, False),
        ("zmq", False, False),
        ("transformers", True, False),
    ]


@pytest.mark.engine
def test_a_library_only_brought_in_by_another_is_caught() -> None:
    # As pyproject.toml stood before starlette was declared: fastapi brings it, dpserve imports it itself.
    without = {**PROJECT, "dependencies": [t for t in PROJECT["dependencies"] if not t.startswith("starlette")]}
    wrong = undeclared_imports(without, third_party_imports())
    assert wrong and all("starlette" in line for line in wrong), wrong


def test_every_runtime_requirement_has_a_lower_bound() -> None:
    unbounded = [text for text in PROJECT["dependencies"] if lower_bound(Requirement(text)) is None]
    assert not unbounded, unbounded


def test_the_floors_the_code_needs_are_kept() -> None:
    assert not floors_broken(PROJECT), floors_broken(PROJECT)
    # As python-multipart stood before: below the import name the code uses.
    deps = [("python-multipart>=0.0.9" if t.startswith("python-multipart") else t) for t in PROJECT["dependencies"]]
    assert [line.split(":")[0] for line in floors_broken({**PROJECT, "dependencies": deps})] == ["python-multipart"]


@pytest.mark.parametrize("group", ["dependencies", "cpu", "test", "bench"])
def test_what_is_installed_here_is_inside_the_declared_ranges(group: str) -> None:
    texts = PROJECT["dependencies"] if group == "dependencies" else PROJECT["optional-dependencies"][group]
    outside = []
    for requirement in map(Requirement, texts):
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            if group == "dependencies":
                outside.append(f"{requirement} is not installed")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            outside.append(f"{requirement}: {version} installed")
    assert not outside, outside
