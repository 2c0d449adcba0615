"""What the benchmarks that drive streamed completions from closed loops of their own (`fairness`, `lora`) share:
their flags and the frame of a run, the fleet and the routers they start, one streamed request and what it came
to, the TTFT figures of many, their tables and verdicts, and the medians over the rounds of repeated runs
(`--repeat`: `run` 0, 1, ... for each round's rows, -1 for the medians)."""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import aiohttp
import orjson

from benchmarks.fleet import BENCHMARKS, UpPorts, progress, sigterm_unwinds, spawn, start_up, stop_all, wait_ok
from benchmarks.report import format_table, shown
from benchmarks.routers import router_ports
from benchmarks.stats import percentile
from dpserve.flag_types import COUNT
from dpserve.up.process import terminate

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

CHILDREN: list[subprocess.Popen[bytes]] = []
"""Every fleet and router a run started, to stop whatever is still running when it ends (`framed`)."""


# -- the frame of a run ------------------------------------------------------------------------------


def names_of(known: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of `known` names."""

    def parse(text: str) -> list[str]:
        given = [name for name in text.split(",") if name]
        unknown = set(given) - set(known)
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown: {sorted(unknown)}, of {', '.join(known)}")
        return given

    return parse


def bench_parser(name: str, doc: str | None, experiments: Sequence[str], repeat: int) -> argparse.ArgumentParser:
    """`dpserve bench NAME`'s parser with the flags every such benchmark has: `--experiments` (of
    `experiments`, all by default), `--repeat` (default `repeat`), `--cache-dir`, `--records`, `--out`."""
    parser = argparse.ArgumentParser(
        prog=f"dpserve bench {name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--experiments", type=names_of(experiments), default=",".join(experiments), help="of " + ", ".join(experiments)
    )
    parser.add_argument(
        "--repeat", type=COUNT, default=repeat, help="rounds of every run, taking turns; medians reported"
    )
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dpserve")
    parser.add_argument("--records", action="store_true", help="also write every request of every run (CSV)")
    parser.add_argument("--out", type=Path, default=BENCHMARKS / "results" / name)
    return parser


@contextlib.contextmanager
def framed(args: argparse.Namespace, name: str, report: Callable[[], str]) -> Iterator[Path]:
    """A run of `dpserve bench NAME`: --out made, the CPUs and load average said, a fresh work folder for its
    fleets yielded; SIGTERM unwinds the block like Ctrl-C, and whatever it started and did not stop is stopped
    as it ends (a signal can end the event loop before its tasks' own `finally` runs). Then, if it ended
    normally, `report()`'s text is printed."""
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"dpserve-bench-{name}-"))
    progress(f"{os.cpu_count()} CPUs; load average before: {os.getloadavg()[0]:.2f}")
    with sigterm_unwinds():
        try:
            yield work
        finally:
            stop_all([p for p in CHILDREN if p.poll() is None], 30)
    text = report()
    print()
    print(text)
    print(f"wrote {shown(args.out)}/{name}.md and its CSVs")


async def start_fleet(
    session: aiohttp.ClientSession, count: int, folder: Path, flags: Sequence[str]
) -> tuple[subprocess.Popen[bytes], list[str]]:
    """`dpserve up` with `flags` (`--sim N`, `--replicas N`, ...; its own router stays idle), its run folder and
    log in `folder`, on ports below 32768: it and its replicas' URLs once every replica answers."""
    ports = UpPorts(count, router_ports(2 * count + 1))
    command = [*ports.command(folder, "least_loaded"), *flags]
    os.makedirs(folder, exist_ok=True)
    process = await start_up(session, ports, command, folder / "up.log", dict(os.environ), 900)
    CHILDREN.append(process)
    return process, ports.replica_urls


async def start_router(
    session: aiohttp.ClientSession, command: Callable[[int], list[str]], log: str, ready: str, timeout_s: float
) -> tuple[subprocess.Popen[bytes], str]:
    """`command(port)` on a free port below 32768 (the next one free too: vllm-router's metrics), its output in
    `LOG-PORT.log` in the temporary folder: it and its URL once `ready` (a path) answers; stopped if it never
    does."""
    port = router_ports(2)
    process = spawn(command(port), Path(tempfile.gettempdir()) / f"{log}-{port}.log", dict(os.environ))
    CHILDREN.append(process)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ok(session, f"{url}{ready}", timeout_s, process)
    except BaseException:
        terminate(process, 30)
        raise
    return process, url


# -- one streamed request ----------------------------------------------------------------------------


class Outcome:
    """A request's record: `ok` when it ended in a complete answer (no error `code`)."""

    code: str

    @property
    def ok(self) -> bool:
        return not self.code


@dataclass
class Reply(Outcome):
    """One streamed request as its client saw it."""

    start: float
    """Seconds on the caller's clock."""
    end: float
    ttft: float
    """Seconds from start to the first event `is_token` counts; NaN without one."""
    status: int
    """HTTP status; 0: no answer (connection failed or timed out)."""
    code: str
    """Empty for a complete answer; else the error's `code`, `http_NNN`, `broken` (the stream ended without
    [DONE]), `stream_error` or `connection`."""
    tokens: int
    """The events `is_token` counted."""
    header: str
    """The answer's value of the header the call named; empty without one."""


def error_code(status: int, body: bytes) -> str:
    """The `code` of an OpenAI-style error body, else `http_NNN`."""
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError, KeyError):
        code = orjson.loads(body)["error"]["code"]
        if isinstance(code, str) and code:
            return code
    return f"http_{status}"


def has_choices(chunk: dict[str, Any]) -> bool:
    """A completions chunk with a choice: one token each (`ignore_eos`, no usage chunk)."""
    return bool(chunk.get("choices"))


async def request(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    clock: Callable[[], float],
    is_token: Callable[[dict[str, Any]], bool] = has_choices,
    header: str = "",
) -> Reply:
    """POST `body` to `url` and read its server-sent events to [DONE]: the TTFT to the first event `is_token`
    counts, how many it counted, and how the request ended (`header`: an answer header to keep)."""
    start = clock()
    ttft, tokens, status, code, value = math.nan, 0, 0, "broken", ""
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            status = resp.status
            value = resp.headers.get(header, "") if header else ""
            if status != 200:
                code = error_code(status, await resp.read())
            else:
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        code = ""
                        break
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        code = "stream_error"
                        break
                    if is_token(chunk):
                        tokens += 1
                        if tokens == 1:
                            ttft = clock() - start
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        code = "connection"
    return Reply(start, clock(), ttft, status, code, tokens, value)


# -- figures, tables, verdicts -----------------------------------------------------------------------


class Timed(Protocol):
    """A record with a TTFT (seconds, NaN without one) that says whether it ended in a complete answer."""

    ttft: float

    @property
    def ok(self) -> bool: ...


def ttft_ms(records: Sequence[Timed]) -> list[float]:
    """The answers' TTFTs in ms, sorted."""
    return sorted(r.ttft * 1000 for r in records if r.ok and not math.isnan(r.ttft))


def ms(values: Sequence[float], q: float) -> float:
    """The `q`th percentile of sorted `values`, to 0.1."""
    return round(percentile(list(values), q), 1)


def table(columns: Sequence[tuple[str, str]], rows: Sequence[object]) -> str:
    """The rows' `columns` (header, field) as a text table; an empty cell shows as `-`."""
    cells = [["-" if (value := getattr(r, name)) == "" else value for _, name in columns] for r in rows]
    return format_table([header for header, _ in columns], cells)


# -- rounds ------------------------------------------------------------------------------------------

Row = TypeVar("Row", bound="DataclassInstance")


def distinct(texts: Sequence[str]) -> str:
    """The rounds' different non-empty texts, in order."""
    return " ".join(dict.fromkeys(t for t in texts if t))


def medians(
    rows: Sequence[Row],
    keys: Sequence[object],
    names: Sequence[str],
    summed: Callable[[str], bool] = lambda name: False,
    merged: Mapping[str, Callable[[Sequence[str]], str]] | None = None,
) -> list[Row]:
    """Per key (the values of the fields `names`; with one name, a key as is): one row with `run` -1 of the
    median of each figure over the key's runs (NaN left out), whole numbers that `summed` names added up,
    other whole numbers the first run's where they all agree, flags true where most runs' are, and texts the
    first run's unless `merged` names a way to join them. Nothing for a key with fewer than two runs."""
    joiners = merged or {}
    out: list[Row] = []
    for key in dict.fromkeys(keys):
        wanted = key if isinstance(key, tuple) else (key,)
        runs = [r for r in rows if tuple(getattr(r, n) for n in names) == wanted]
        if len(runs) < 2:
            continue
        values: dict[str, Any] = {}
        for f in fields(runs[0]):
            seen = [getattr(r, f.name) for r in runs]
            if f.name == "run":
                values[f.name] = -1
            elif isinstance(seen[0], str):
                values[f.name] = joiners[f.name](seen) if f.name in joiners else seen[0]
            elif isinstance(seen[0], bool):
                values[f.name] = 2 * sum(seen) > len(seen)
            elif isinstance(seen[0], int) and summed(f.name):
                values[f.name] = sum(seen)
            elif isinstance(seen[0], int) and len(set(seen)) == 1:
                values[f.name] = seen[0]
            else:
                known = [v for v in seen if not math.isnan(v)]
                values[f.name] = round(statistics.median(known), 3) if known else math.nan
        out.append(type(runs[0])(**values))
    return out


def write_rows(
    args: argparse.Namespace, name: str, rows: Sequence[Any], verdicts: Sequence[str], csv_name: str, hidden: str = ""
) -> str:
    """A benchmark's dataclass rows as `--out/CSV_NAME`, and `--out/NAME.md`: the command line, the rows as a
    table (less the column `hidden`) and the verdicts. Returns the Markdown."""
    names = [f.name for f in fields(rows[0])] if rows else []
    with (args.out / csv_name).open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)
    columns = [(column.replace("_", " "), column) for column in names if column != hidden]
    lines = [f"# dpserve bench {name}", "", f"`{' '.join(args.argv) or '(defaults)'}`", ""]
    text = "\n".join([*lines, "```", table(columns, rows), "```", "", *verdicts, ""])
    (args.out / f"{name}.md").write_text(text)
    return text
