"""docs/cli.md, the reference of every `dpserve` command and flag, generated from the parser itself:
`python -m dpserve.cli_docs` rewrites it, and a unit test fails when it no longer matches."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from dpserve.cli import build_parser

DOCS_FILE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
REGENERATE = "python -m dpserve.cli_docs"
WIDTH = "100"
"""argparse wraps help to the terminal's width (COLUMNS): fixed, so the file is the same on every machine."""

HEADER = f"""# Command-line reference

[Back to the front page](../README.md)

Generated from `dpserve`'s parser by `{REGENERATE}`: do not edit by hand. Every setting of `dpserve router`,
`up`, `sim` and `agent` is also read from the environment variable its help names (flags win); an old
variable name (`DPSERVE_READ_TIMEOUT_S`) still works, with a warning, and an unknown `DPSERVE_` variable is
named in a warning at start. `dpserve tune` and `dpserve bench NAME` parse their own flags (`--help`).
"""


def _commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every command under it, depth first, in the order they were added; not those that parse
    their own flags (`add_help=False`: `dpserve tune`, `dpserve bench NAME`)."""
    if parser.add_help:
        yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in dict.fromkeys(action.choices.values()):
                yield from _commands(command)


def render() -> str:
    with mock.patch.dict(os.environ, {"COLUMNS": WIDTH}):
        sections = [HEADER]
        for command in _commands(build_parser()):
            sections.append(f"## {command.prog}\n\n```text\n{command.format_help().rstrip()}\n```\n")
    return "\n".join(sections)


def main() -> int:
    DOCS_FILE.write_text(render(), encoding="utf-8")
    print(f"wrote {DOCS_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
