"""Bad input to every command, generated from the settings' declarations: each flag, environment variable and
config file entry given values its setting cannot take (wrong types, negatives, empty, huge numbers, unknown
choices), and files that cannot be read (missing, not YAML, not a mapping, unknown keys). Each case must stop
with exit 2 (1 for a file that cannot be written), no traceback, and an error naming the flag, variable or key,
before anything is served: `_serve`, which binds the ports, fails the case if reached."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import pytest
import yaml

from dpserve import cli, flag_types
from dpserve.checkout import BENCH_MODULES, benchmark_module
from dpserve.cli import build_parser, main
from dpserve.config import (
    LARGEST_FLOAT,
    LARGEST_INT,
    AgentSettings,
    Form,
    RouterSettings,
    Setting,
    SimSettings,
    UpSettings,
    environment_names,
    settings_of,
)
from dpserve.tune import command as tune_command

REPO = Path(__file__).resolve().parents[2]
WITH_CONFIG = ("router", "up", "sim")


@dataclasses.dataclass(frozen=True)
class Case:
    command: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    file: str | None = None
    """A config file's text, given as --config."""
    named: str = ""
    """What the error must name: the flag, the variable, the key."""
    code: int = 2

    @property
    def id(self) -> str:
        where = self.file if self.file is not None else " ".join(f"{k}={v}" for k, v in self.env)
        return f"{self.command} {' '.join(self.argv)} {where}"[:120]


def command_settings() -> Iterator[tuple[str, type[Any], str, Setting]]:
    """(command, group, field name, declaration) of every setting each command takes by flag."""
    groups = {"router": [RouterSettings], "up": [UpSettings, RouterSettings], "sim": [SimSettings]}
    groups["agent"] = [AgentSettings]
    for command, of_command in groups.items():
        for group in of_command:
            own = group is not RouterSettings or command == "router"
            for name, found in settings_of(group):
                if found.router_only and not own:
                    continue  # `dpserve up` sets these itself
                yield command, group, name, found


def _kind(group: type[Any], name: str) -> Any:
    """The setting's type, less `| None`."""
    hint = get_type_hints(group)[name]
    args = getattr(hint, "__args__", ())
    return next(arg for arg in args if arg is not type(None)) if type(None) in args else hint


def out_of_range(group: type[Any], name: str, found: Setting) -> list[float]:
    """Numbers just below the least setting `name` takes and past the most (a number setting)."""
    kind = _kind(group, name)
    least = found.minimum if found.minimum is not None else 0
    port = name == "port" or name.endswith("_port")
    if kind is int:
        most = found.maximum if found.maximum is not None else 65535 if port else LARGEST_INT
        return [int(least) - 1, int(most) + 1, 10**30]
    most = found.maximum if found.maximum is not None else LARGEST_FLOAT
    return [least - 1, most * 10 if most else 1.0]


def bad_texts(group: type[Any], name: str, found: Setting) -> list[str]:
    """Texts setting `name` cannot take, as a flag's or a variable's value."""
    kind = _kind(group, name)
    if found.form in (Form.SWITCH, Form.OFF_SWITCH, Form.ON_OFF):
        return ["maybe"]
    if found.form in (Form.REPEAT, Form.LIST) or get_origin(kind) is tuple:
        return []  # any text is a list of texts; a REPEAT's empty item is a flag case
    if kind in (int, float):
        other = ["1.5"] if kind is int else ["nan", "inf"]
        return ["abc", "", *other, *(str(number) for number in out_of_range(group, name, found))]
    if found.choices or name in cli.FLAG_CHOICES:
        return ["no-such-choice", ""]
    return [""]  # text and paths: never empty


def bad_entries(group: type[Any], name: str, found: Setting) -> list[Any]:
    """YAML values setting `name` cannot take in a config file."""
    kind = _kind(group, name)
    if found.form in (Form.REPEAT, Form.LIST) or get_origin(kind) is tuple:
        return [{"a": 1}, [["nested"]], [""]]
    if kind is bool:
        return ["maybe", 5, [True]]
    if kind in (int, float):
        other = [1.5] if kind is int else [float("nan"), float("inf")]
        return ["abc", True, [1], {"a": 1}, *other, *out_of_range(group, name, found)]
    return ["", [1], {"a": 1}, *(["no-such-choice"] if found.choices or name in cli.FLAG_CHOICES else [])]


def cases() -> Iterator[Case]:
    for command, group, name, found in command_settings():
        assert found.flag is not None or name == "vllm_args"
        if found.flag is not None:
            values = bad_texts(group, name, found)
            if found.form is Form.REPEAT:
                values = [""]
            elif found.form in (Form.SWITCH, Form.OFF_SWITCH):
                values = []
            for text in values:
                yield Case(command, (f"{found.flag}={text}",), named=found.flag)
        if found.env is not None and found.form not in (Form.REPEAT, Form.LIST):
            for text in bad_texts(group, name, found):
                if text:  # an empty variable is unset
                    yield Case(command, (), env=((found.env, text),), named=found.env)
        if command in WITH_CONFIG:
            key = (found.flag or "--" + name.replace("_", "-")).removeprefix("--")
            for value in bad_entries(group, name, found):
                text = yaml.safe_dump({key: value})
                yield Case(command, (), file=text, named=f"settings.yaml: {key}")
    yield from file_cases()
    yield from other_commands()
    yield from bench_cases()
    yield from address_cases()


def file_cases() -> Iterator[Case]:
    for command in WITH_CONFIG:
        yield Case(command, ("--config", "/no/such/settings.yaml"), named="/no/such/settings.yaml")
        yield Case(command, ("--config", "/"), named="--config /")  # a folder
        for text in ("port: [1\n", "a: b: c\n", "- 1\n- 2\n", "just text\n", "\tport: 1\n", "{port: 1\n"):
            yield Case(command, (), file=text, named="settings.yaml")
        for key in ("prot", "max-model-lenn", "replicas-count", "api_key_files", "1", "null", "--port"):
            yield Case(command, (), file=f"{key}: 1\n", named=f"settings.yaml: {key}")
        yield Case(command, (), file="port: 1\nport_: 2\n", named="settings.yaml: port_")
        yield Case(command, (), file="host: a\nhost: b\n", named="settings.yaml")
    yield Case("up", (), file="replica: [http://a:1]\n", named="settings.yaml: replica")
    yield Case("up", (), file="peer: [http://a:1]\n", named="settings.yaml: peer")


def other_commands() -> Iterator[Case]:
    """The commands whose flags are not settings: counts, files."""
    for flag in ("--replicas", "--gpus", "--routers", "--router-workers", "--tensor-parallel-size", "--max-loras"):
        for text in ("0", "-1", "abc", ""):
            yield Case("compose", (f"{flag}={text}",), named=flag)
    for flag in ("--routers", "--router-replicas", "--router-workers", "--tensor-parallel-size", "--max-lora-rank"):
        for text in ("0", "-2", "x"):
            # kube's own check names --routers by its first name
            named = "--router" if flag == "--routers" and text != "x" else flag
            yield Case("kube", ("--replicas", "1", f"{flag}={text}"), named=named)
    for text in ("0", "-1", "many"):
        yield Case("kube", (f"--replicas={text}",), named="--replicas")
    yield Case("kube", (), named="--replicas")  # required
    yield Case("compose", ("--lora", "nameonly"), named="--lora")
    yield Case("kube", ("--replicas", "1", "--lora-affinity", "maybe"), named="--lora-affinity")
    yield Case("compose", ("-o", "/no/such/folder/compose.yaml"), named="/no/such/folder/compose.yaml", code=1)
    yield Case("kube", ("--replicas", "1", "-o", "/no/such/folder/k.yaml"), named="/no/such/folder/k.yaml", code=1)
    for flag, text in (("--count", "-1"), ("--rank", "0"), ("--seed", "-1"), ("--count", "x")):
        yield Case("model", ("tiny-lora", "/tmp/unused", "--count", "1", flag, text), named=flag)
    yield Case("model", ("tiny", "/tmp/unused", "--seed", "x"), named="--seed")
    yield Case("gpus", ("--jsn",), named="--jsn")
    for url in ("notaurl", "http://", "127.0.0.1:8000", "http://x:1/v1", "ftp://x:1"):
        yield Case("batch", ("--router", url), named="--router")
        yield Case("batch", (), env=(("DPSERVE_ROUTER_URL", url),), named="DPSERVE_ROUTER_URL")
    yield Case("batch", ("--folow",), named="--folow")
    yield Case("nosuchcommand", (), named="nosuchcommand")


BAD_REPLICAS = (
    "notaurl", "ftp://x:1", "http://", "http://x:1/v1", "10.0.0.2:8000", "a=notaurl", "http://x:1@gpu=",
    "http://x:1@dp=0", "bad name!=http://x:1", "gpu-a=http:///x",
)  # fmt: skip
BAD_OTLP = ("notaurl", "http://", "ftp://x:4317", "x:port", "/v1/traces", "http://x y:4317", ":4317")


def address_cases() -> Iterator[Case]:
    """Replica and collector addresses that are no URL: refused when read, not probed or exported to for ever."""
    for spec in BAD_REPLICAS:
        yield Case("router", (f"--replica={spec}",), named="--replica")
        yield Case("router", (), file=yaml.safe_dump({"replica": [spec]}), named="--replica")
    yield Case("router", ("--replica", "http://x:1", "--replica", "notaurl"), named="--replica 'notaurl'")
    yield Case("router", (), env=(("DPSERVE_REPLICAS", "notaurl"),), named="--replica 'notaurl'")
    for endpoint in BAD_OTLP:
        for command in ("router", "up"):
            yield Case(command, (f"--otlp-traces-endpoint={endpoint}",), named="--otlp-traces-endpoint")
            yield Case(command, (), env=(("DPSERVE_OTLP_TRACES_ENDPOINT", endpoint),), named="--otlp-traces-endpoint")
            text = yaml.safe_dump({"otlp-traces-endpoint": endpoint})
            yield Case(command, (), file=text, named="--otlp-traces-endpoint")


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(parse_args: Callable[[list[str]], argparse.Namespace]) -> argparse.ArgumentParser:
    """The parser a benchmark's (or tune's) `parse_args` builds, taken just before it parses."""

    def built(self: argparse.ArgumentParser, *_: object) -> argparse.Namespace:
        raise _Built(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", built)
        try:
            parse_args([])
        except _Built as found:
            return found.parser
    raise AssertionError(f"{parse_args} parsed nothing")


def own_parsers() -> dict[tuple[str, ...], Callable[[list[str]], argparse.Namespace]]:
    """The commands that parse their own flags, by their words (`bench sim`, `tune`): their `parse_args`."""
    found = {("bench", name): benchmark_module(name).parse_args for name in BENCH_MODULES}
    return {**found, ("tune",): tune_command.parse_args}


OWN_PARSERS = own_parsers()


def bad_flag_texts(action: argparse.Action) -> list[str]:
    """Texts a bench or tune flag cannot take, from its type's bounds."""
    kind = action.type
    if isinstance(kind, flag_types.Number):
        whole = kind.kind is int
        least = kind.least if kind.above else kind.least - 1
        most = 10**30 if whole else kind.most * 10
        return ["abc", "", *(["1.5"] if whole else ["nan", "inf", "-inf"]), f"{least:g}", str(most)]
    if kind is flag_types.counts:
        return ["", ",", "0", "1,0", "-1", "1,x", "1.5", str(10**30)]
    if isinstance(kind, flag_types.Names):
        return ["no-such-name", f"{kind.known[0]},no-such-name", *([] if kind.empty else ["", ","])]
    if kind in (flag_types.existing_file, flag_types.existing_folder):
        return ["/no/such/path", ""]
    if action.choices is not None:
        return ["no-such-choice", ""]
    return []


def bench_cases() -> Iterator[Case]:
    """`dpserve bench NAME` and `dpserve tune`: every flag whose values are bounded, given what it cannot take."""
    for words, parse_args in OWN_PARSERS.items():
        for action in parser_of(parse_args)._actions:
            if not action.option_strings or action.nargs == 0:
                continue  # the positionals, --help and the switches
            flag = max(action.option_strings, key=len)
            for text in bad_flag_texts(action):
                yield Case(words[0], (*words[1:], f"{flag}={text}"), named=f"argument {flag}")
    for name in ("sim", "soak"):
        yield Case("bench", (name, "--no-such-flag=1"), named="--no-such-flag")
    yield Case("tune", (), named="--receipts")  # required
    for url in ("notaurl", "", "ftp://x:1", "http://x:1/v1"):
        yield Case("bench", ("lora", f"--replica={url}"), named="argument --replica")
    for name, flag in (("lora", "--experiments"), ("fairness", "--experiments"), ("fairness", "--contenders")):
        yield Case("bench", (name, f"{flag}=nosuch"), named=f"argument {flag}")
    for target in ("nosuch", ",", "vllm-router@abc:round_robin", "dpserve:kv_aware+more", "dpserve:"):
        yield Case("bench", ("cost", f"--targets={target}"), named="argument --targets")


CASES = list(cases())
PARSER = build_parser()
"""Parsers are stateless once built: one for all cases keeps the fuzz fast."""


@pytest.fixture(autouse=True)
def nothing_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """A case that passed the checks would bind its ports here: it fails instead. No setting comes from the
    environment running the tests."""

    def serve(*_: object) -> int:
        raise AssertionError("the settings passed every check: the command would serve")

    monkeypatch.setattr(cli, "_serve", serve)
    for words, parse_args in OWN_PARSERS.items():
        monkeypatch.setattr(sys.modules[parse_args.__module__], "parse_args", checked_only(words, parse_args))
    monkeypatch.setattr(cli, "build_parser", lambda: PARSER)
    for variable in environment_names():
        monkeypatch.delenv(variable, raising=False)


def checked_only(
    words: tuple[str, ...], parse_args: Callable[[list[str]], argparse.Namespace]
) -> Callable[[list[str]], argparse.Namespace]:
    """`parse_args` that fails the case where the flags passed every check: the benchmark would start."""

    def parse(argv: list[str]) -> argparse.Namespace:
        parse_args(argv)
        raise AssertionError(f"dpserve {' '.join(words)} {' '.join(argv)}: passed every check, it would run")

    return parse


def test_the_fuzz_has_at_least_200_cases_from_every_command() -> None:
    assert len(CASES) >= 200
    commands = {case.command for case in CASES}
    assert commands >= {"router", "up", "sim", "agent", "compose", "kube", "model", "gpus", "bench", "tune", "batch"}
    assert {case.argv[0] for case in CASES if case.command == "bench"} == set(BENCH_MODULES)
    assert sum(case.file is not None for case in CASES) >= 200
    assert sum(bool(case.env) for case in CASES) >= 200


def source(case: Case) -> str:
    return "file" if case.file is not None else "env" if case.env else "flags"


GROUPS = sorted({(case.command, source(case)) for case in CASES})


@pytest.mark.parametrize(("command", "given"), GROUPS, ids=[f"{command}-{given}" for command, given in GROUPS])
def test_bad_input_is_refused_without_a_traceback_naming_what_was_wrong(
    command: str, given: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every case of one command and one source, in a loop (a test each would cost pytest's set-up 2900 times);
    the failures listed together."""
    failures = []
    ran = 0
    for case in CASES:
        if (case.command, source(case)) != (command, given):
            continue
        ran += 1
        code, err = run(case, tmp_path)
        if code != case.code or "Traceback" in err or case.named not in err:
            failures.append(f"{case.id!r}: exit {code}, must name {case.named!r}:\n{err[-600:]}")
    assert ran
    assert not failures, f"{len(failures)} of {ran} cases:\n" + "\n".join(failures[:20])


def run(case: Case, tmp_path: Path) -> tuple[object, str]:
    """(exit code, stderr) of `dpserve` given `case`."""
    argv = [case.command, *case.argv]
    if case.file is not None:
        path = tmp_path / "settings.yaml"
        path.write_text(case.file, encoding="utf-8")
        argv += ["--config", str(path)]
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(io.StringIO()) as err:
        for variable, value in case.env:
            patch.setenv(variable, value)
        try:
            code: object = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue()


@pytest.mark.parametrize("words", list(OWN_PARSERS), ids=" ".join)
def test_every_number_flag_of_bench_and_tune_has_bounds(words: tuple[str, ...]) -> None:
    """A plain int or float takes -1, 0 and nan: each number flag takes a bounded type, which the fuzz reads."""
    unbounded = [
        max(action.option_strings, key=len)
        for action in parser_of(OWN_PARSERS[words])._actions
        if action.type in (int, float)
        or (
            (action.option_strings and action.type is None and isinstance(action.default, (int, float)))
            and not isinstance(action.default, bool)
        )
    ]
    assert not unbounded, f"dpserve {' '.join(words)}: unbounded number flags {unbounded}"


def test_a_good_bench_flag_reaches_the_guard(capsys: pytest.CaptureFixture[str]) -> None:
    """The guard that keeps the fuzz from running a benchmark fails a case whose flags pass."""
    with pytest.raises(AssertionError, match="it would run"):
        main(["bench", "sim", "--sims", "2"])


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["sim"], {"DPSERVE_PORT": "abc"}, "DPSERVE_PORT: 'abc' is not a whole number"),
        (["sim", "--count", "0"], {}, "argument --replicas/--count: '0' must be at least 1"),
        (["sim"], {"DPSERVE_SIM_COUNT": "0"}, "DPSERVE_SIM_COUNT: '0' must be at least 1"),
        (["up"], {"DPSERVE_NUM_REPLICAS": "-1"}, "DPSERVE_NUM_REPLICAS: '-1' must be at least 1"),
    ],
)
def test_the_installed_command_refuses_bad_environment_values_too(
    argv: list[str], env: dict[str, str], named: str
) -> None:
    """As a user runs it: a process of its own, its environment as given."""
    clean = {key: value for key, value in os.environ.items() if key not in environment_names()}
    done = subprocess.run(
        [sys.executable, "-m", "dpserve", *argv],
        env={**clean, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert named in done.stderr
