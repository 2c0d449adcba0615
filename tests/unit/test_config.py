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
