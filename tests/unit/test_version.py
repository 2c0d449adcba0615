"""One version, declared in pyproject.toml, read everywhere else; the licence and the changelog beside it."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

from dpserve import version
from dpserve.cli import main

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_version_is_pyprojects_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", PROJECT["version"])
    assert version.checkout_version() == version.package_version() == PROJECT["version"]
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.split() == ["dpserve", PROJECT["version"]]
    # No second declaration: the package itself names no version of its own.
    assert not [p for p in (ROOT / "dpserve").rglob("*.py") if re.search(r"__version__\s*=", p.read_text())]


def test_a_checkout_never_installed_reads_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert version.package_version() == PROJECT["version"]
    monkeypatch.setattr(version, "PYPROJECT", ROOT / "no-such-pyproject.toml")
    assert version.package_version() == "unknown"


def test_the_changelog_has_this_version() -> None:
    headings = re.findall(r"^## \[?(\d+\.\d+\.\d+)\]?", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings and headings[0] == PROJECT["version"], "CHANGELOG.md's newest entry is the version pyproject names"


def test_the_licence_is_apache_2_and_declared() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]


def test_the_readme_says_where_it_runs_on_its_first_screen() -> None:
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:25])
    assert "Linux x86-64" in first_screen and "Python 3.11" in first_screen
