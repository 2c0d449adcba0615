from __future__ import annotations

from pathlib import Path

import pytest

from dpserve.config import RouterSettings, SimSettings, UpSettings, load_settings


def test_flags_beat_environment_beats_defaults() -> None:
    env = {"DPSERVE_PORT": "9000", "DPSERVE_POLICY": "round_robin", "DPSERVE_PROBE_INTERVAL_S": "0.25"}
    settings = load_settings(RouterSettings, {"port": 9100, "policy": None}, env=env)
    assert settings.port == 9100  # flag
    assert settings.policy == "round_robin"  # env, since the flag was not given
    assert settings.probe_interval_s == 0.25
    assert settings.host == "127.0.0.1"  # default: loopback only


def test_environment_types() -> None:
    env = {
        "DPSERVE_REPLICAS": "http://a:1, http://b:2",
        "DPSERVE_ACCESS_LOG": "yes",
        "DPSERVE_NUM_REPLICAS": "3",
        "DPSERVE_CACHE_DIR": "/tmp/x",
    }
    settings = load_settings(UpSettings, env=env)
    assert settings.router.replicas == ("http://a:1", "http://b:2")
    assert settings.router.access_log is True and settings.num_replicas == 3 and settings.cache_dir == Path("/tmp/x")


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="DPSERVE_PORT"):
        load_settings(RouterSettings, env={"DPSERVE_PORT": "eighty"})


def test_each_command_loads_its_own_group_from_the_same_flags_and_environment() -> None:
    env = {"DPSERVE_PORT": "9000", "DPSERVE_SIM_SPEED": "0", "DPSERVE_BASE_PORT": "9100"}
    flags = {"policy": "session", "num_replicas": 3, "sim_block_size": 32, "command": "up"}
    up = load_settings(UpSettings, flags, env=env)
    assert (up.num_replicas, up.base_port, up.router.port, up.router.policy) == (3, 9100, 9000, "session")
    sim = load_settings(SimSettings, flags, env=env)
    assert (sim.port, sim.sim_speed, sim.sim_block_size) == (9000, 0.0, 32)
    router = load_settings(RouterSettings, flags, env=env)
    assert (router.port, router.policy) == (9000, "session")
    assert not hasattr(router, "num_replicas") and not hasattr(router, "sim_speed")


def test_lora_settings_from_flags_and_environment() -> None:
    env = {"DPSERVE_LORA": "sql=/adapters/sql, chat=/adapters/chat", "DPSERVE_LORA_AFFINITY": "off"}
    router = load_settings(RouterSettings, {"lora_dir": "/adapters"}, env=env)
    assert router.lora == ("sql=/adapters/sql", "chat=/adapters/chat")
    assert router.lora_adapters == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    assert (router.lora_dir, router.lora_affinity) == ("/adapters", False)
    defaults = RouterSettings()
    assert (defaults.lora, defaults.lora_dir, defaults.lora_affinity) == ((), None, True)
    up = load_settings(UpSettings, {"max_loras": 4}, env={"DPSERVE_MAX_LORA_RANK": "64"})
    assert (up.enable_lora, up.max_loras, up.max_lora_rank, up.lora_enabled) == (False, 4, 64, False)
    # LoRA in the replicas: asked for, or implied by adapters given to the router.
    assert UpSettings(enable_lora=True).lora_enabled
    assert UpSettings(RouterSettings(lora=("a=/x",))).lora_enabled
    assert UpSettings(RouterSettings(lora_dir="/adapters")).lora_enabled
    assert (UpSettings().max_loras, UpSettings().max_lora_rank) == (2, 16)


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("sql", "expected NAME=PATH"),
        ("=/adapters/sql", "NAME must be non-empty"),
        ("my sql=/adapters/sql", "without whitespace"),
        ("sql=", "PATH is empty"),
        ("sql= ", "PATH is empty"),
    ],
)
def test_a_malformed_lora_adapter_is_refused_at_load(spec: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        load_settings(RouterSettings, {"lora": (spec,)}, env={})
    if " " not in spec.strip():  # the environment separates adapters by commas or whitespace
        with pytest.raises(ValueError, match=error):
            load_settings(UpSettings, env={"DPSERVE_LORA": f"ok=/adapters/ok,{spec}"})


def test_lora_names_are_unique_and_limits_positive() -> None:
    assert RouterSettings(lora=("a=/x=y",)).lora_adapters == {"a": "/x=y"}  # the first `=` splits
    with pytest.raises(ValueError, match="'a': given twice"):
        RouterSettings(lora=("a=/x", "a=/y"))
    with pytest.raises(ValueError, match="--lora-dir must name a folder"):
        RouterSettings(lora_dir=" ")
    with pytest.raises(ValueError, match="--max-loras: 0 must be at least 1"):
        load_settings(UpSettings, {"max_loras": 0}, env={})
    with pytest.raises(ValueError, match="DPSERVE_MAX_LORA_RANK: '-1' must be at least 1"):
        load_settings(UpSettings, env={"DPSERVE_MAX_LORA_RANK": "-1"})


def test_the_cli_refuses_bad_lora_settings_with_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dpserve.cli import main

    for argv in (
        ["router", "--replica", "http://127.0.0.1:9", "--lora", "sql"],
        ["up", "--lora", "=/adapters/sql"],
        ["up", "--max-loras", "0"],
        ["up", "--lora-affinity", "maybe"],
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "Traceback" not in capsys.readouterr().err
    monkeypatch.setenv("DPSERVE_LORA", "sql")
    with pytest.raises(SystemExit) as exit_:
        main(["router", "--replica", "http://127.0.0.1:9"])
    assert exit_.value.code == 2
    assert "router: LoRA adapter 'sql': expected NAME=PATH" in capsys.readouterr().err
