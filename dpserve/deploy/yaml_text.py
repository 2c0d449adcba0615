"""Compose files as YAML text: block style, keys in the order written, multi-line strings as `|` blocks,
and Compose's `!reset` tag (an override file's way to remove an attribute of the file it extends)."""

from __future__ import annotations

from typing import Any

import yaml


class Reset:
    """`!reset {}`: in an override file, removes the attribute from the merged service."""

    def __repr__(self) -> str:
        return "Reset()"


_FLOW_WIDTH = 60


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no types
    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        # Lists indented under their key, as Compose files are usually written.
        super().increase_indent(flow, False)

    def ignore_aliases(self, data: Any) -> bool:
        # Every service spelled out in full: no &anchors for values that happen to be shared.
        return True


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


def _represent_list(dumper: yaml.SafeDumper, items: list[Any]) -> yaml.Node:
    # Short lists of plain values on one line ([gpu], [CMD, ...]); long ones, one item per line.
    short = all(isinstance(item, (str, int, float)) for item in items) and len(str(items)) <= _FLOW_WIDTH
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=short)


def _represent_reset(dumper: yaml.SafeDumper, _: Reset) -> yaml.Node:
    return dumper.represent_mapping("!reset", {}, flow_style=True)


_Dumper.add_representer(str, _represent_str)
_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(Reset, _represent_reset)


class ComposeLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types
    """Reads what `dump` writes, `!reset` included."""


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())


def dump(document: dict[str, Any], header: str = "") -> str:
    body: str = yaml.dump(document, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)
    comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comments + body


def load(text: str) -> Any:
    return yaml.load(text, Loader=ComposeLoader)
