"""How far a routing policy's predictions were from what the replicas then reported, over a receipts log
(`--receipts-log`): per prediction source (`kv_events`, `routed_text`) and policy, realized less predicted cached
tokens (lowest, highest, mean, median), the receipts by class and the block each was classed against (for
routed text, a 64-character chunk in the model's tokens, or the engine's block when larger).

    python -m benchmarks.receipt_errors LOG [LOG ...]

Record a log with `dpserve bench policies --dpserve-args "--receipts-log FILE"` (every request gets a receipt
there) or `dpserve router --receipts-log FILE --receipts-sample 1`. A receipt without both figures (a policy that
predicts nothing, an error) is counted but has no error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import format_table


@dataclass(frozen=True)
class Errors:
    source: str
    policy: str
    receipts: int
    scored: int
    """Receipts with both a prediction and a realized figure."""
    lowest: int
    highest: int
    mean: float
    median: float
    classes: dict[str, int]
    block_tokens: dict[int, int]
    """The block a receipt was classed against, in tokens: receipts per size."""


def errors(rows: Iterable[dict[str, Any]]) -> list[Errors]:
    """Realized less predicted cached tokens, per (source, policy), in first-seen order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((str(row.get("source")), str(row.get("policy"))), []).append(row)
    out = []
    for (source, policy), group in groups.items():
        deltas = [
            row["realized_cached_tokens"] - row["predicted_cached_tokens"]
            for row in group
            if isinstance(row.get("realized_cached_tokens"), int)
            and isinstance(row.get("predicted_cached_tokens"), int)
        ]
        out.append(
            Errors(
                source,
                policy,
                len(group),
                len(deltas),
                min(deltas, default=0),
                max(deltas, default=0),
                statistics.fmean(deltas) if deltas else 0.0,
                statistics.median(deltas) if deltas else 0.0,
                dict(Counter(str(row.get("class")) for row in group)),
                dict(sorted(Counter(int(row.get("block_tokens") or 0) for row in group).items())),
            )
        )
    return out


def read_log(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def report(found: Sequence[Errors]) -> str:
    header = ("source", "policy", "receipts", "scored", "realized-predicted min", "max", "mean", "median")
    rows = [
        (e.source, e.policy, e.receipts, e.scored, e.lowest, e.highest, f"{e.mean:+.1f}", f"{e.median:+.1f}")
        for e in found
    ]
    lines = [format_table(header, rows), ""]
    for e in found:
        classes = " ".join(f"{name}={count}" for name, count in sorted(e.classes.items()))
        blocks = " ".join(f"{size}={count}" for size, count in e.block_tokens.items())
        lines.append(f"{e.source} {e.policy}: classes {classes}; classed against a block of (tokens=receipts) {blocks}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.receipt_errors",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("logs", type=Path, nargs="+", help="receipts logs (JSON lines)")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    rows = [row for path in args.logs for row in read_log(path)]
    if not rows:
        print("no receipts", file=sys.stderr)
        return 1
    print(report(errors(rows)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
