"""What every benchmark's report is made of: the text table, the CSV, the figure, and paths shown as the
repository knows them (results are committed, so they must not carry this machine's paths)."""

from __future__ import annotations

import contextlib
import csv
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from benchmarks.fleet import CHECKOUT
from dpserve.text_table import format_table

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes

__all__ = ["DPI", "figure", "format_table", "read_rows", "shown", "write_csv"]

RowT = TypeVar("RowT", bound="DataclassInstance")

DPI = 110


def shown(path: Path | str) -> str:
    """`path` for a report: relative to the repository checkout when it is inside it (a result's own text names
    `benchmarks/results/...`, not this machine's folders), else as given."""
    resolved = Path(path).resolve()
    with contextlib.suppress(ValueError):
        return str(resolved.relative_to(CHECKOUT))
    return str(path)


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> None:
    """`rows` under a header of `columns` (default: the first row's keys); a header alone when there are no
    rows and `columns` are given."""
    names = list(columns) if columns is not None else list(rows[0]) if rows else []
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)


# A CSV cell back as its field's declared type; the annotations are strings (`from __future__ import annotations`).
CELL_PARSERS: dict[str, Callable[[str], int | float | str]] = {"int": int, "float": float, "str": str}


def read_rows(kind: type[RowT], path: Path) -> list[RowT]:
    """The `kind` dataclass rows a CSV holds (as write_csv wrote them from `asdict`): each cell read as its field's
    declared type (int, float or str); a field the CSV lacks keeps its default."""
    parsers = {field.name: CELL_PARSERS[str(field.type)] for field in fields(kind)}
    with open(path, newline="") as handle:
        return [
            kind(**{name: parsers[name](text) for name, text in record.items()}) for record in csv.DictReader(handle)
        ]


@contextlib.contextmanager
def figure(
    path: Path,
    titles: Sequence[str],
    size: tuple[float, float],
    *,
    xlabel: str | None = None,
    legend: str = "axes",
    legend_columns: int = 1,
    legend_space: float = 0.0,
    legend_loc: str = "best",
    grid: bool = False,
    suptitle: str | None = None,
) -> Iterator[list[Axes]]:
    """A row of one panel per title, drawn by the caller in the `with` block, then titled, labelled, given its
    legend, laid out and saved as a PNG at DPI; the figure is closed however the block ends (saved only if it
    ends normally).

    legend: `axes`, one per panel (fontsize 8, at `legend_loc`); `figure`, one for the whole figure below the
    panels (`legend_columns` wide, `legend_space` of the height kept for it), each label once, in the order the
    panels first show it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid_axes = plt.subplots(1, len(titles), figsize=size, squeeze=False)
    axes = list(grid_axes[0])
    try:
        yield axes
        for axis, title in zip(axes, titles, strict=True):
            axis.set_title(title)
            if xlabel is not None:
                axis.set_xlabel(xlabel)
            if grid:
                axis.grid(alpha=0.3)
        if legend == "axes":
            for axis in axes:
                axis.legend(fontsize=8, loc=legend_loc)
        elif legend == "figure":
            by_label: dict[str, Artist] = {}
            for axis in axes:
                for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
                    by_label.setdefault(label, handle)
            fig.legend(by_label.values(), by_label.keys(), fontsize=8, ncol=legend_columns, loc="lower center")
        if suptitle is not None:
            fig.suptitle(suptitle, fontsize=10)
        fig.tight_layout(rect=(0, legend_space, 1, 1))
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def goals_status(bench: str, goals: Sequence[tuple[str, bool]]) -> int:
    """A benchmark's exit status from its goal lines (each: the line, whether all its goals were met): 1, said
    on stderr, when any was missed; else 0. The figures are written before, either way."""
    missed = sum(1 for _, ok in goals if not ok)
    if missed:
        print(f"dpserve bench {bench}: {missed} of {len(goals)} goal lines NOT met", file=sys.stderr)
        return 1
    return 0
