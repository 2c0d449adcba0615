"""The recorded fleet's timing, fitted from its receipts: each answer's time on its replica against the
prompt tokens the replica computed (prompt less the cached tokens vLLM reported) and the tokens it
generated, by least squares: seconds = overhead + prefill x computed + decode x generated. The replay's
latency model then times requests as that fleet did, not as the simulator's defaults would."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_REQUESTS = 8
"""Fewer timed receipts than this fit nothing."""


@dataclass(frozen=True, slots=True)
class TimedAnswer:
    computed_tokens: int
    """Prompt tokens the replica computed: the prompt less what it reported cached."""
    generated_tokens: int
    seconds: float
    """From the router's send to the answer's end."""


@dataclass(frozen=True, slots=True)
class FittedTiming:
    prefill_s_per_token: float | None
    """None: the trace cannot tell (every prompt computed about as much, or the fit came out negative)."""
    decode_s_per_token: float | None
    """None: the trace cannot tell (every answer the same length, or the fit came out negative)."""
    overhead_s: float
    requests: int


def fit_timing(answers: Sequence[TimedAnswer]) -> FittedTiming | None:
    """None with too few answers. A term the answers do not vary is left out of the fit (None)."""
    count = len(answers)
    if count < MIN_REQUESTS:
        return None
    columns = [[float(a.computed_tokens) for a in answers], [float(a.generated_tokens) for a in answers]]
    times = [a.seconds for a in answers]
    varied = [i for i, column in enumerate(columns) if _spread(column) > 1e-9 * max(1.0, _mean(column) ** 2)]
    slopes = _least_squares([columns[i] for i in varied], times)
    fitted: list[float | None] = [None, None]
    for i, slope in zip(varied, slopes, strict=True):
        fitted[i] = slope if slope > 0 else None
    overhead = _mean(times) - sum(slope * _mean(columns[i]) for i, slope in zip(varied, slopes, strict=True))
    return FittedTiming(fitted[0], fitted[1], max(0.0, overhead), count)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _spread(values: Sequence[float]) -> float:
    mean = _mean(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def _least_squares(columns: Sequence[Sequence[float]], target: Sequence[float]) -> list[float]:
    """Slopes of `target` on `columns` (one or two, each varied), with an intercept: the centred normal
    equations, solved directly."""
    if not columns:
        return []
    y_mean = _mean(target)
    centred = [[v - _mean(column) for v in column] for column in columns]
    y = [t - y_mean for t in target]

    def dot(a: Sequence[float], b: Sequence[float]) -> float:
        return sum(x * z for x, z in zip(a, b, strict=True))

    if len(centred) == 1:
        return [dot(centred[0], y) / dot(centred[0], centred[0])]
    a, b = centred
    aa, ab, bb, ay, by = dot(a, a), dot(a, b), dot(b, b), dot(a, y), dot(b, y)
    determinant = aa * bb - ab * ab
    if abs(determinant) <= 1e-12 * aa * bb:  # the two move together: the computed tokens alone
        return [ay / aa, 0.0]
    return [(ay * bb - by * ab) / determinant, (by * aa - ay * ab) / determinant]
