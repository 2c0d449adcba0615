"""A small reader for the Prometheus text format: just the samples the router needs from vLLM."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

Labels = dict[str, str]


@dataclass
class Samples:
    by_name: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)

    def total(self, name: str) -> float | None:
        """Sum over every label set (vLLM reports one series per engine), None when absent."""
        series = self.by_name.get(name)
        if not series:
            return None
        return sum(value for _, value in series)

    def first_labels(self, name: str) -> Labels | None:
        series = self.by_name.get(name)
        return series[0][0] if series else None

    def engines(self, name: str) -> list[int]:
        """The engines (vLLM's `engine` label: a data-parallel server's ranks) that report `name`."""
        found = {labels.get(ENGINE, "") for labels, _ in self.by_name.get(name, ())}
        return sorted(int(engine) for engine in found if engine.isdigit())

    def of_engine(self, rank: int) -> Samples:
        """Only engine `rank`'s series, and the series no engine is named on (the server's own)."""
        wanted = str(rank)
        return Samples(
            {
                name: [(labels, value) for labels, value in series if labels.get(ENGINE, wanted) == wanted]
                for name, series in self.by_name.items()
            }
        )


ENGINE = "engine"


def parse_samples(text: str, wanted: Collection[str]) -> Samples:
    """Samples whose metric name is in `wanted`; other lines are skipped without parsing."""
    samples = Samples()
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        name_end = brace if 0 <= brace < space or (brace >= 0 and space < 0) else space
        if name_end < 0:
            continue
        name = line[:name_end]
        if name not in wanted:
            continue
        labels: Labels = {}
        rest = line[name_end:]
        if rest.startswith("{"):
            close = _closing_brace(rest)
            if close < 0:
                continue
            labels = _parse_labels(rest[1:close])
            rest = rest[close + 1 :]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        samples.by_name.setdefault(name, []).append((labels, value))
    return samples


def _closing_brace(text: str) -> int:
    in_quotes = False
    escaped = False
    for index, char in enumerate(text):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            in_quotes = not in_quotes
        elif char == "}" and not in_quotes:
            return index
    return -1


def _parse_labels(body: str) -> Labels:
    labels: Labels = {}
    index = 0
    while index < len(body):
        eq = body.find("=", index)
        if eq < 0 or eq + 1 >= len(body) or body[eq + 1] != '"':
            break
        key = body[index:eq].strip().lstrip(",").strip()
        value_chars: list[str] = []
        cursor = eq + 2
        while cursor < len(body):
            char = body[cursor]
            if char == "\\" and cursor + 1 < len(body):
                nxt = body[cursor + 1]
                value_chars.append({"n": "\n", '"': '"', "\\": "\\"}.get(nxt, nxt))
                cursor += 2
                continue
            if char == '"':
                break
            value_chars.append(char)
            cursor += 1
        labels[key] = "".join(value_chars)
        index = cursor + 1
        while index < len(body) and body[index] in ", ":
            index += 1
    return labels
