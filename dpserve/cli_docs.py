"""docs/cli.md, the reference of every `dpserve` command and flag, generated from the parser itself:
`python -m dpserve.cli_docs` rewrites it, and a unit test fails when it no longer matches."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

from dpserve.cli import SETTINGS_OF, build_parser
from dpserve.config import Form, file_keys, settings_of, type_hints

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DOCS_FILE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
REGENERATE = "python -m dpserve.cli_docs"
WIDTH = "100"
"""argparse wraps help to the terminal's width (COLUMNS): fixed, so the file is the same on every machine."""

HEADER = f"""# Command-line reference

[Back to the front page](../README.md)

Generated from `dpserve`'s parser by `{REGENERATE}`: do not edit by hand. Every setting of `dpserve router`,
`up`, `sim` and `agent` is also read from the environment variable its help names (flags win); an old
variable name (`DPSERVE_READ_TIMEOUT_S`) still works, with a warning, and an unknown `DPSERVE_` variable is
named in a warning at start. `dpserve router`, `up` and `sim` also read a YAML file (`--config FILE`): its form,
every key with its default, follows each of their flags.
"""
WITH_CONFIG = ("router", "up", "sim")


def _commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every command under it, depth first, in the order they were added; not those that parse
    their own flags (`add_help=False`: `dpserve tune`, `dpserve bench NAME`)."""
    if parser.add_help:
        yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in dict.fromkeys(action.choices.values()):
                yield from _commands(command)


def file_form(command: str) -> str:
    """`--config FILE` for `dpserve COMMAND`: every key it takes, set to its default (a default that depends on
    the machine, commented out), so the text read back gives the defaults."""
    group = SETTINGS_OF[command]
    lines = [f"# dpserve {command} --config FILE: every key, with its default"]
    for key, name in file_keys(group).items():
        owner = next(g for g in (group, *_groups_within(group)) if name in dict(settings_of(g)))
        found = dict(settings_of(owner))[name]
        if key != (found.flag or "--" + name.replace("_", "-")).removeprefix("--"):
            continue  # an older name of the same setting
        default = getattr(owner(), name)
        if found.form is Form.OFF_SWITCH:
            default = not default  # `no-gpu-health: false` is the default
        if next(f for f in dataclasses.fields(owner) if f.name == name).default_factory is not dataclasses.MISSING:
            lines.append(f"# {key}:  (this machine's)")
            continue
        lines.append(f"{key}: {_yaml(default)}")
    return "\n".join(lines)


def _groups_within(group: type[DataclassInstance]) -> list[type[DataclassInstance]]:
    return [hint for hint in type_hints(group).values() if isinstance(hint, type) and dataclasses.is_dataclass(hint)]


def _yaml(value: object) -> str:
    """A default as YAML reads it back."""
    if value is None:
        return "null"
    if isinstance(value, tuple):
        return "[" + ", ".join(json.dumps(item) for item in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"{value:g}" if isinstance(value, float) else str(value)
    return json.dumps(str(value))  # quoted: `on`, `1.5` or `*` would read as something else


def render() -> str:
    with mock.patch.dict(os.environ, {"COLUMNS": WIDTH}):
        sections = [HEADER]
        for command in _commands(build_parser()):
            sections.append(f"## {command.prog}\n\n```text\n{command.format_help().rstrip()}\n```\n")
            name = command.prog.removeprefix("dpserve ")
            if name in WITH_CONFIG:
                sections.append(f"`--config FILE` for `{command.prog}`:\n\n```yaml\n{file_form(name)}\n```\n")
    return "\n".join(sections)


def main() -> int:
    DOCS_FILE.write_text(render(), encoding="utf-8")
    print(f"wrote {DOCS_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
