"""A request's SLO: its own headers (`x-slo-ttft-ms`, `x-slo-tpot-ms`; llm-d's `x-llm-d-slo-ttft-ms` and
`x-llm-d-slo-tpot-ms` alike), else its tenant's rules; none: best effort. And the refusal when no replica is
predicted to meet it."""

from __future__ import annotations

import math
from collections.abc import Mapping

from dpserve.policies.base import Slo
from dpserve.router.flow.tenants import TenantRules
from dpserve.router.http.errors import OpenAIError, bad_request

TTFT_HEADERS = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
TPOT_HEADERS = ("x-slo-tpot-ms", "x-llm-d-slo-tpot-ms")
SLO_HEADERS = (*TTFT_HEADERS, *TPOT_HEADERS)
MAX_MS = 3_600_000.0


def slo_of(headers: Mapping[str, str], rules: TenantRules) -> Slo | None:
    """The request's SLO, its headers first; 400 for a header that is not a number of milliseconds."""
    ttft = _header_ms(headers, TTFT_HEADERS)
    tpot = _header_ms(headers, TPOT_HEADERS)
    if ttft is None:
        ttft = rules.slo_ttft_s
    if tpot is None:
        tpot = rules.slo_tpot_s
    if ttft is None and tpot is None:
        return None
    return Slo(ttft, tpot, rules.slo_queue)


def _header_ms(headers: Mapping[str, str], names: tuple[str, ...]) -> float | None:
    for name in names:
        text = headers.get(name)
        if text is None:
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value <= MAX_MS:  # NaN fails too
            raise bad_request(f"`{name}` must be a number of milliseconds above 0, at most {MAX_MS:.0f}.", param=name)
        return value / 1000.0
    return None


def slo_unattainable(slo: Slo, predicted_s: float, waited_s: float = 0.0) -> OpenAIError:
    """429 at once: no replica is predicted to meet the SLO (the nearest predicts `predicted_s` to the first
    token, after `waited_s` in the router's queue); Retry-After is how far that is past it."""
    predicted = max(predicted_s, 0.0)
    late = predicted - slo.ttft_s if slo.ttft_s is not None else 0.0
    promised = []
    if slo.ttft_s is not None:
        promised.append(f"a first token within {slo.ttft_s * 1000:.0f} ms")
    if slo.tpot_s is not None:
        promised.append(f"{slo.tpot_s * 1000:.0f} ms per token")
    waited = f" (after {waited_s * 1000:.0f} ms waiting in the router's queue)" if waited_s > 0 else ""
    return OpenAIError(
        429,
        f"No replica is predicted to meet this request's SLO ({' and '.join(promised)}); the nearest predicts a "
        f"first token in {predicted * 1000:.0f} ms{waited}. Retry later, or send it without an SLO as best effort.",
        type="rate_limit_error",
        code="slo_unattainable",
        headers={"retry-after": str(max(1, math.ceil(late)))},
    )
