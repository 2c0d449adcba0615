"""`dpserve tune --receipts FILE`: the kv_aware weights that suit a recorded workload best, and the
defaults beside them, in the same units as `dpserve bench policies` (hit rate, TTFT)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dpserve.flag_types import COUNT, NON_NEGATIVE, WHOLE, existing_file
from dpserve.sim.engine import LatencyModel
from dpserve.text_table import format_table
from dpserve.tune.replay import DEFAULTS, FleetModel, Outcome, TraceRequest, grid, read_receipts, tune
from dpserve.tune.timing import TimedAnswer, fit_timing


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dpserve tune", description=__doc__)
    parser.add_argument(
        "--receipts",
        type=existing_file,
        required=True,
        help="a routing receipts log (`dpserve router --receipts-log FILE --receipts-sample 1`, kv_aware)",
    )
    parser.add_argument("--replicas", type=COUNT, help="replicas to model (default: those the receipts name)")
    parser.add_argument("--kv-blocks", type=WHOLE, default=0, help="each replica's KV cache in blocks (0: unbounded)")
    parser.add_argument(
        "--prefill-ms-per-token",
        type=NON_NEGATIVE,
        help="per computed prompt token (default: fitted to the receipts' times, else 0.1)",
    )
    parser.add_argument(
        "--decode-ms-per-token",
        type=NON_NEGATIVE,
        help="per output token (default: fitted to the receipts' times, else 10)",
    )
    parser.add_argument("--batch-slowdown", type=NON_NEGATIVE, default=0.02, help="per other running request (0.02)")
    parser.add_argument("--max-num-seqs", type=COUNT, default=256, help="batch limit (256)")
    parser.add_argument("--top", type=COUNT, default=5, help="settings to show (5)")
    return parser.parse_args(list(argv))


def _row(label: str, outcome: Outcome) -> tuple[str, ...]:
    s = outcome.setting
    return (
        label,
        f"{s.load_weight:g}",
        f"{s.kv_weight:g}",
        f"{s.held_weight:g}",
        f"{s.balance_rel:g}+{s.balance_abs}",
        f"{outcome.hit_rate:.3f}",
        f"{outcome.ttft_mean_ms:.1f}",
        f"{outcome.ttft_p50_ms:.1f}",
        f"{outcome.ttft_p99_ms:.1f}",
        f"{outcome.max_share:.2f}",
    )


def fleet_timing(
    requests: Sequence[TraceRequest], prefill_ms: float | None, decode_ms: float | None
) -> tuple[float, float, str]:
    """Seconds per computed prompt token and per output token for the replay: as given, else fitted to the
    receipts' times (`replica_s`), else the simulator's defaults; and a line saying which."""
    fitted = None
    if prefill_ms is None or decode_ms is None:
        fitted = fit_timing(
            [
                TimedAnswer(r.prompt_tokens - r.cached_tokens, r.completion_tokens, r.seconds)
                for r in requests
                if r.seconds is not None and r.cached_tokens is not None
            ]
        )
    defaults = LatencyModel()
    note = f"fitted to {fitted.requests} receipts' times" if fitted else ""
    prefill = _pick(prefill_ms, fitted.prefill_s_per_token if fitted else None, note, defaults.prefill_s_per_token)
    decode = _pick(decode_ms, fitted.decode_s_per_token if fitted else None, note, defaults.decode_s_per_token)
    line = ", ".join(
        f"{name} {seconds * 1000:.4g} ms/token ({source})"
        for name, (seconds, source) in (("prefill", prefill), ("decode", decode))
    )
    return prefill[0], decode[0], f"timing: {line}"


def _pick(given_ms: float | None, fitted_s: float | None, fitted_note: str, default_s: float) -> tuple[float, str]:
    """Seconds per token and where they came from."""
    if given_ms is not None:
        return given_ms / 1000, "given"
    if fitted_s is not None:
        return fitted_s, fitted_note
    return default_s, "the simulator's default"


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    try:
        with open(args.receipts, encoding="utf-8") as handle:
            requests, named = read_receipts(handle)
    except OSError as exc:
        print(f"dpserve tune: {args.receipts}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"dpserve tune: {args.receipts}: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print(
            f"dpserve tune: {args.receipts} has no receipts with prompt blocks: record them with a kv_aware router "
            "(or a kv_aware --shadow-policy), --receipts-log and --receipts-sample 1",
            file=sys.stderr,
        )
        return 2
    replicas = tuple(f"r{i}" for i in range(args.replicas)) if args.replicas else tuple(named)
    if not replicas:
        print("dpserve tune: no replicas: give --replicas N", file=sys.stderr)
        return 2
    prefill_s, decode_s, timing = fleet_timing(requests, args.prefill_ms_per_token, args.decode_ms_per_token)
    latency = LatencyModel(prefill_s, decode_s, args.batch_slowdown)
    fleet = FleetModel(replicas, args.kv_blocks, latency, args.max_num_seqs)
    settings = grid()
    outcomes = tune(requests, fleet, settings)
    defaults = next(o for o in outcomes if o.setting == DEFAULTS)
    span = requests[-1].at - requests[0].at
    print(
        f"{len(requests)} requests over {span:.1f} s, {len(replicas)} replicas, KV cache "
        f"{args.kv_blocks or 'unbounded'} blocks each; {len(settings)} settings of kv_aware tried"
    )
    print(timing)
    header = ("", "load w", "cache w", "held w", "guard", "hit rate", "TTFT mean ms", "p50 ms", "p99 ms", "max share")
    rows = [_row(f"#{rank}", outcome) for rank, outcome in enumerate(outcomes[: args.top], 1)]
    rows.append(_row("defaults", defaults))
    print(format_table(header, rows))
    best = outcomes[0]
    if best.setting == DEFAULTS:
        print("\nno setting tried does better than the defaults on this trace")
    print(f"\nbest: {best.setting.flags()}")
    print(
        f"expected: hit rate {best.hit_rate:.3f} (defaults {defaults.hit_rate:.3f}), "
        f"TTFT mean {best.ttft_mean_ms:.1f} ms (defaults {defaults.ttft_mean_ms:.1f} ms)"
    )
    return 0
