from __future__ import annotations

from pathlib import Path

import pytest

from dpserve.config import Settings


def test_flags_beat_environment_beats_defaults() -> None:
    env = {"DPSERVE_PORT": "9000", "DPSERVE_POLICY": "round_robin", "DPSERVE_PROBE_INTERVAL_S": "0.25"}
    settings = Settings.load({"port": 9100, "policy": None}, env=env)
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
    settings = Settings.load(env=env)
    assert settings.replicas == ("http://a:1", "http://b:2")
    assert settings.access_log is True and settings.num_replicas == 3 and settings.cache_dir == Path("/tmp/x")


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="DPSERVE_PORT"):
        Settings.load(env={"DPSERVE_PORT": "eighty"})
