"""Settings declared once (dpserve/config.py) and the flags, variables and docs generated from them."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from dpserve import cli_docs
from dpserve.cli import build_parser, main
from dpserve.config import (
    AgentSettings,
    RouterSettings,
    SimSettings,
    UpSettings,
    environment_names,
    load_settings,
    settings_argv,
    settings_of,
    unknown_variables,
)

COMMANDS = {"router": RouterSettings, "up": UpSettings, "sim": SimSettings, "agent": AgentSettings}
NOT_SETTINGS = {"peer_siblings", "router"}  # set by --workers for each worker; UpSettings' router group


def command(name: str) -> argparse.ArgumentParser:
    (commands,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = commands.choices[name]
    return parser


def flags_by_dest(name: str) -> dict[str, argparse.Action]:
    return {action.dest: action for action in command(name)._actions if action.option_strings}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_setting_has_a_flag_whose_help_names_its_variable(name: str) -> None:
    group = COMMANDS[name]
    flags = flags_by_dest(name)
    declared = dict(settings_of(group))
    for f in dataclasses.fields(group):
        if f.name in NOT_SETTINGS:
            assert f.name not in declared
            continue
        found = declared[f.name]
        if found.flag is None:  # given after `--`
            assert f.name == "vllm_args"
            continue
        assert found.flag in flags[f.name].option_strings
        if not found.hidden:
            assert f"env {found.env}" in str(flags[f.name].help), found.flag


def test_router_flags_and_their_variables_are_the_contract() -> None:
    flags = {string: action.dest for action in command("router")._actions for string in action.option_strings}
    for flag in ("--replica", "--policy", "--port", "--kv-events", "--api-key", "--discover", "--peer"):
        assert flag in flags
    for flag in ("--lora-dir", "--workers", "--read-timeout", "--no-gpu-health", "--gpu-pcie-busy", "--tenant"):
        assert flag in flags
    # The settings that could be given only in the environment before.
    for flag in ("--probe-timeout", "--passive-fail-threshold", "--backpressure-backoff", "--retry-backoff"):
        assert flag in flags
    envs = {flag: found.env for _, found in settings_of(RouterSettings) for flag in [found.flag]}
    assert envs["--read-timeout"] == "DPSERVE_READ_TIMEOUT"  # the flag's name
    assert envs["--replica"] == "DPSERVE_REPLICAS"  # a repeated flag: the list's name
    assert envs["--api-key"] == "DPSERVE_API_KEYS"
    assert envs["--no-gpu-health"] == "DPSERVE_GPU_HEALTH"


def test_flags_beat_the_environment_beat_defaults_and_old_names_still_work(caplog: pytest.LogCaptureFixture) -> None:
    args = build_parser().parse_args(["router", "--read-timeout", "30"])
    flags = {key: value for key, value in vars(args).items() if value is not None}
    env = {"DPSERVE_READ_TIMEOUT": "60", "DPSERVE_CONNECT_TIMEOUT": "7", "DPSERVE_PROBE_TIMEOUT_S": "9"}
    with caplog.at_level(logging.WARNING, logger="dpserve.config"):
        settings = load_settings(RouterSettings, flags, env=env)
    assert settings.read_timeout_s == 30.0  # the flag
    assert settings.connect_timeout_s == 7.0  # the environment
    assert settings.write_timeout_s == RouterSettings().write_timeout_s == 60.0  # the default
    assert settings.probe_timeout_s == 9.0  # an old name
    assert "DPSERVE_PROBE_TIMEOUT_S is deprecated: use DPSERVE_PROBE_TIMEOUT" in caplog.text
    assert "DPSERVE_CONNECT_TIMEOUT" not in caplog.text
    both = {"DPSERVE_PROBE_TIMEOUT": "4", "DPSERVE_PROBE_TIMEOUT_S": "9"}
    assert load_settings(RouterSettings, env=both).probe_timeout_s == 4.0  # the new name wins


def test_sim_and_agent_variables() -> None:
    sim = load_settings(SimSettings, env={"DPSERVE_SIM_BLOCK_SIZE": "32", "DPSERVE_PORT": "9001"})
    assert (sim.sim_block_size, sim.port) == (32, 9001)
    assert load_settings(AgentSettings, env={"DPSERVE_INTERVAL": "2.5"}).interval_s == 2.5
    assert load_settings(UpSettings, env={"DPSERVE_START_TIMEOUT": "5"}).replica_start_timeout_s == 5.0


def test_an_unknown_variable_is_named_with_the_closest_known_one() -> None:
    env = {"DPSERVE_READ_TIMOUT": "5", "DPSERVE_PORT": "1", "DPSERVE_ZZZ": "1", "DPSERVE_FAKE_NVML_FILE": "x"}
    lines = unknown_variables(env)
    assert lines == [
        "DPSERVE_READ_TIMOUT is set, but no dpserve setting reads it: did you mean DPSERVE_READ_TIMEOUT?",
        "DPSERVE_ZZZ is set, but no dpserve setting reads it",
    ]
    # An old name suggests the new one.
    assert "DPSERVE_READ_TIMEOUT" in unknown_variables({"DPSERVE_READ_TIMEOUT_SS": "5"})[0]
    assert environment_names()["DPSERVE_READ_TIMEOUT_S"] == "DPSERVE_READ_TIMEOUT"


def test_the_cli_warns_of_an_unknown_variable_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DPSERVE_POLCY", "kv_aware")
    with pytest.raises(SystemExit):
        main(["router"])  # no replicas: it stops after the check
    err = capsys.readouterr().err
    assert (
        "dpserve: warning: DPSERVE_POLCY is set, but no dpserve setting reads it: did you mean DPSERVE_POLICY?" in err
    )


def test_the_variables_the_project_sets_are_known() -> None:
    # compose files, Kubernetes manifests and `dpserve up` hand keys to the router through these.
    assert unknown_variables({"DPSERVE_API_KEYS": "k", "DPSERVE_ADMIN_KEYS": "a"}) == []
    # `make test` exports the build's variables to every process the suite starts (empty ones too).
    assert unknown_variables({"DPSERVE_PURE_PYTHON": "", "DPSERVE_BUILD": "compiled", "DPSERVE_COMPILE": "1"}) == []


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out.split()
    assert out[0] == "dpserve" and out[1][0].isdigit()


def test_router_help_is_grouped_with_defaults() -> None:
    text = command("router").format_help()
    for title in ("routing:", "flow control:", "replica health:", "GPU health:", "peers:", "LoRA:", "security:"):
        assert f"\n{title}\n" in text
    assert "default: 0.05; env DPSERVE_KV_LOAD_WEIGHT" in " ".join(text.split())
    up = command("up").format_help()
    assert "--read-timeout" in up and "--replica " not in up  # `dpserve up` sets the replicas itself


def test_settings_argv_reads_back_as_the_same_settings() -> None:
    changed = RouterSettings(
        read_timeout_s=12.0,
        flow_control=False,
        gpu_health=False,
        insecure=True,
        tenants=("a:rpm=1,tpm=2", "b:weight=3"),
        gpu_ignored_xids=("13",),
        api_keys=("secret",),
    )
    argv = settings_argv(changed)
    assert "secret" not in argv and "--api-key" not in argv  # keys go through the environment
    args = build_parser().parse_args(["router", *argv])
    flags = {key: tuple(v) if isinstance(v, list) else v for key, v in vars(args).items()}
    assert load_settings(RouterSettings, flags, env={}) == dataclasses.replace(changed, api_keys=())
    assert settings_argv(RouterSettings()) == []


def test_docs_cli_md_is_generated_from_the_parser() -> None:
    assert cli_docs.DOCS_FILE.read_text(encoding="utf-8") == cli_docs.render(), (
        f"docs/cli.md differs from the parser: run `{cli_docs.REGENERATE}`"
    )
