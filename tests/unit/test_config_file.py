"""`--config FILE`: settings in YAML keyed by the flags' names, flags over the file over the environment, every
value checked (pydantic) with an error that names the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpserve import cli_docs
from dpserve.cli import _load_settings, _overrides, build_parser, main
from dpserve.config import (
    ConfigFile,
    RouterSettings,
    SettingError,
    SimSettings,
    UpSettings,
    environment_names,
    load_settings,
)


@pytest.fixture(autouse=True)
def no_setting_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in environment_names():
        monkeypatch.delenv(variable, raising=False)


def write(tmp_path: Path, text: str, name: str = "settings.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load(group: type[RouterSettings | UpSettings | SimSettings], path: Path, *argv: str, **env: str) -> object:
    """`group` as `dpserve COMMAND --config PATH ARGV` loads it, with `env` as the environment."""
    command = {RouterSettings: "router", UpSettings: "up", SimSettings: "sim"}[group]
    args = build_parser().parse_args([command, "--config", str(path), *argv])
    with pytest.MonkeyPatch.context() as patch:
        for variable, value in env.items():
            patch.setenv(variable, value)
        return _load_settings(group, args.config, _overrides(args))


def test_keys_are_the_flags_names_with_dashes_or_underscores_and_lists_for_repeated_flags(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
replica: [http://10.0.0.1:8000, http://10.0.0.2:8000]
read-timeout: 120
max_in_flight: 64
flow-control: off
no-gpu-health: true
gpu-ignored-xids: [13, 31]
api-key: [team-a:key-aaaaaaaa, key-bbbbbbbb]
api-key-file: keys/api.txt
log-level: debug
""",
    )
    settings = load(RouterSettings, path)
    assert isinstance(settings, RouterSettings)
    assert settings.replicas == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert (settings.read_timeout_s, settings.max_in_flight, settings.log_level) == (120.0, 64, "debug")
    assert settings.flow_control is False and settings.gpu_health is False
    assert settings.gpu_ignored_xids == ("13", "31")  # YAML's numbers, as the flag's text
    assert settings.api_keys == ("team-a:key-aaaaaaaa", "key-bbbbbbbb")  # secrets may be in the file
    assert settings.api_key_file == tmp_path / "keys" / "api.txt"  # relative to the file's folder


def test_flags_beat_the_file_which_beats_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "port: 9001\nread-timeout: 120\nprobe-interval: 2\n")
    env = {"DPSERVE_PORT": "9002", "DPSERVE_READ_TIMEOUT": "30", "DPSERVE_CONNECT_TIMEOUT": "7"}
    settings = load(RouterSettings, path, "--port", "9000", **env)
    assert isinstance(settings, RouterSettings)
    assert settings.port == 9000  # the flag
    assert settings.read_timeout_s == 120.0 and settings.probe_interval_s == 2.0  # the file
    assert settings.connect_timeout_s == 7.0  # the environment
    assert settings.write_timeout_s == RouterSettings().write_timeout_s  # the default


def test_up_takes_its_own_keys_the_routers_and_vllms_args(tmp_path: Path) -> None:
    path = write(tmp_path, "replicas: 3\nmax-model-len: 8192\npolicy: session\nvllm-args: [--dtype, half]\n")
    settings = load(UpSettings, path)
    assert isinstance(settings, UpSettings)
    assert (settings.num_replicas, settings.max_model_len, settings.router.policy) == (3, 8192, "session")
    assert settings.vllm_args == ("--dtype", "half")
    # What `dpserve up` sets for its router itself is refused, by name.
    with pytest.raises(SettingError, match=r"replica is `dpserve router`'s only"):
        ConfigFile.read(write(tmp_path, "replica: [http://a:1]\n")).check_keys(UpSettings)


def test_sim_takes_replicas_and_its_first_name_count(tmp_path: Path) -> None:
    for key in ("replicas", "count"):
        settings = load(SimSettings, write(tmp_path, f"{key}: 3\nmax-num-seqs: 4\nspeed: 0\n"))
        assert isinstance(settings, SimSettings)
        assert (settings.sim_count, settings.sim_max_num_seqs, settings.sim_speed) == (3, 4, 0.0)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("read-timeout: abc\n", "read-timeout: 'abc' is not a number"),
        ("port: -1\n", "port: -1 must be at least 0"),
        ("port: 70000\n", "port: 70000 must be at most 65535"),
        ("workers: 0\n", "workers: 0 must be at least 1"),
        ("retries: 1.5\n", "retries: 1.5 is not a whole number"),
        ("retries: true\n", "retries: True is not a number"),
        ("read-timeout: .nan\n", "read-timeout: nan is not a finite number"),
        ("policy: fastest\n", "policy: 'fastest' is not one of 'round_robin'"),
        ("host: ''\n", "host: '' is empty"),
        ("access-log: maybe\n", "access-log: 'maybe' is not true or false"),
        ("replica: {a: 1}\n", "replica: {'a': 1} is not a list"),
        ("replica: [http://a:1, [x]]\n", "replica: item 2, ['x'] is not text"),
        ("read-timout: 5\n", "read-timout is no setting of this command; did you mean read-timeout?"),
        ("read-timeout: 5\nread_timeout: 6\n", "read_timeout and read-timeout are the same setting, given twice"),
        ("- port: 1\n", "expected flag names and their values (max-model-len: 8192), not a list"),
        ("port: [1\n", "not valid YAML at line 2, column 1"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_file_and_the_key(tmp_path: Path, text: str, error: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SettingError) as refused:
        load(RouterSettings, path)
    assert str(refused.value).startswith(f"--config {path}: ")
    assert error in str(refused.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingError, match=f"--config {tmp_path / 'none.yaml'}: No such file or directory"):
        ConfigFile.read(tmp_path / "none.yaml")


def test_the_command_refuses_a_bad_file_with_exit_2_and_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "read-timeout: abc\n", "router.yaml")
    with pytest.raises(SystemExit) as exit_:
        main(["router", "--config", str(path), "--replica", "http://127.0.0.1:9"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"dpserve: error: router: --config {path}: read-timeout: 'abc' is not a number" in err
    assert "Traceback" not in err


def test_an_environment_value_is_checked_as_a_files_is(monkeypatch: pytest.MonkeyPatch) -> None:
    for env, error in (
        ({"DPSERVE_PORT": "abc"}, "DPSERVE_PORT: 'abc' is not a whole number"),
        ({"DPSERVE_SIM_COUNT": "0"}, "DPSERVE_SIM_COUNT: '0' must be at least 1"),
        ({"DPSERVE_SIM_SPEED": "-1"}, "DPSERVE_SIM_SPEED: '-1' must be at least 0"),
        ({"DPSERVE_LOG_LEVEL": "loud"}, "DPSERVE_LOG_LEVEL: 'loud' is not one of"),
        ({"DPSERVE_ACCESS_LOG": "maybe"}, "DPSERVE_ACCESS_LOG: 'maybe' is not true or false"),
    ):
        with pytest.raises(SettingError) as refused:
            load_settings(SimSettings, env=env)
        assert error in str(refused.value)


def test_compose_counts_replicas_as_up_and_kube_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env_file = tmp_path / "none.env"  # no GPUS to fall back on
    out = tmp_path / "compose.yaml"
    assert (
        main(["compose", "--replicas", "2", "--tensor-parallel-size", "2", "--env-file", str(env_file), "-o", str(out)])
        == 0
    )
    text = out.read_text(encoding="utf-8")
    assert "(4 GPU(s), Qwen/Qwen2.5-1.5B-Instruct, 2 replica(s) of 2 GPUs)" in capsys.readouterr().err
    assert (
        main(["compose", "--gpus", "4", "--tensor-parallel-size", "2", "--env-file", str(env_file), "-o", str(out)])
        == 0
    )
    assert out.read_text(encoding="utf-8") == text  # --gpus, its first form, still taken
    with pytest.raises(SystemExit) as exit_:
        main(["compose", "--replicas", "2", "--gpus", "4"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_docs_show_the_file_form_which_reads_back_as_the_defaults(tmp_path: Path) -> None:
    text = cli_docs.DOCS_FILE.read_text(encoding="utf-8")
    for command, group in (("router", RouterSettings), ("up", UpSettings), ("sim", SimSettings)):
        section = text.split(f"## dpserve {command}\n", 1)[1].split("\n## ", 1)[0]
        assert "--config FILE" in section
        form = cli_docs.file_form(command)
        assert f"```yaml\n{form}\n```" in section
        config = ConfigFile.read(write(tmp_path, form))
        config.check_keys(group)
        assert len(config.entries) > 10
        assert load_settings(group, env={}, config=config) == group()
