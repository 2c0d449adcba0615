"""Plain-text tables for the terminal: `dpserve up`'s fleet, `dpserve gpus` and the benchmarks' reports."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def format_table(header: Sequence[object], rows: Iterable[Sequence[object]], align: str = "left") -> str:
    """`header` and `rows` as lines of columns two spaces apart, each as wide as its widest cell (`str()` of
    it), aligned `left` or `right`; no trailing spaces."""
    if align not in ("left", "right"):
        raise ValueError(f"align must be left or right, not {align!r}")
    lines = [[str(cell) for cell in row] for row in (header, *rows)]
    widths = [max(len(line[column]) for line in lines) for column in range(len(lines[0]))]
    pad = str.ljust if align == "left" else str.rjust
    return "\n".join(
        "  ".join(pad(cell, width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines
    )
