from __future__ import annotations

import dataclasses
import importlib.util
import json
import socket
import sys
from pathlib import Path

import pytest

from dpserve.cli import _overrides, build_parser
from dpserve.config import RouterSettings, UpSettings, load_settings
from dpserve.gpu.topology import GpuTopology, read_topology_with
from dpserve.up.launcher import Launcher, _plan, busy_ports, grouping_line, run_launcher
from dpserve.up.plan import (
    PlanError,
    plan_replicas,
    plan_routers,
    plan_sims,
    router_argv,
    router_env,
    split_cores,
)
from tests.fake_nvml import gpus_of_topology


def test_split_cores_disjoint_and_covering() -> None:
    assert split_cores([0, 1], 2) == [(0,), (1,)]
    assert split_cores(range(8), 3) == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert split_cores([0, 1], 3) == [(0,), (1,), (0,)]  # more replicas than cores: shared


def test_cpu_plan_defaults_to_two_pinned_replicas_with_prefix_caching_and_kv_events() -> None:
    plans = plan_replicas(UpSettings(base_port=9100, kv_events_base_port=6000), "/m", "tiny", 0, [0, 1])
    assert [p.id for p in plans] == ["r0", "r1"]
    assert [p.url for p in plans] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    assert [p.cpus for p in plans] == [(0,), (1,)]
    assert plans[1].env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and plans[1].device == "cpu:1"
    argv = plans[1].argv
    assert argv[:3] == (sys.executable, "-m", "vllm.entrypoints.openai.api_server")
    assert argv[argv.index("--port") + 1] == "9101"
    assert argv[argv.index("--served-model-name") + 1] == "tiny"
    assert "--enable-prefix-caching" in argv
    kv = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert kv["endpoint"] == "tcp://*:6001" and kv["enable_kv_cache_events"] is True
    assert plans[1].kv_events_endpoint == "tcp://127.0.0.1:6001"


def test_gpu_plan_is_one_replica_per_gpu() -> None:
    plans = plan_replicas(UpSettings(), "org/model", None, 4, [0, 1])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0", "1", "2", "3"]
    assert [p.device for p in plans] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert all(p.cpus is None for p in plans)
    assert "--served-model-name" not in plans[0].argv
    # CUDA's order made NVML's, so the router's `@gpu=N` names the GPU the replica's CUDA sees.
    assert all(p.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for p in plans)
    args = build_parser().parse_args(list(router_argv(UpSettings(RouterSettings(gpu_interval_s=0.5)), plans)[3:]))
    # Named as the launcher's table names them, so the router's labels are the same.
    assert args.replicas == [f"r{i}=http://127.0.0.1:{8100 + i}@gpu={i}" for i in range(4)]
    assert args.gpu_interval_s == 0.5
    with pytest.raises(PlanError, match="more replicas than the 4 GPUs"):
        plan_replicas(UpSettings(num_replicas=5), "org/model", None, 4, [0])


def test_extra_vllm_flags_pass_through_and_win() -> None:
    extra = ("--served-model-name=mine", "--no-enable-prefix-caching", "--max-model-len", "512", "--seed", "3")
    argv = plan_replicas(UpSettings(vllm_args=extra), "/m", "tiny", 0, [0, 1])[0].argv
    assert argv[-len(extra) :] == extra
    assert "tiny" not in argv and "--enable-prefix-caching" not in argv
    assert argv.count("--max-model-len") == 1


def test_the_context_length_is_the_models_own_unless_given() -> None:
    """As `vllm serve`: no --max-model-len unless --max-model-len (or one after `--`) asks for one."""
    for plans in (plan_replicas(UpSettings(), "/m", None, 0, [0]), plan_sims(UpSettings(sim_replicas=2), "t")):
        assert "--max-model-len" not in plans[0].argv
    given = load_settings(UpSettings, _overrides(build_parser().parse_args(["up", "--max-model-len", "2048"])))
    assert given.max_model_len == 2048
    for plans in (plan_replicas(given, "/m", None, 0, [0]), plan_sims(dataclasses.replace(given, sim_replicas=1), "t")):
        argv = plans[0].argv
        assert argv[argv.index("--max-model-len") + 1] == "2048" and argv.count("--max-model-len") == 1


def test_sim_plan_runs_dpserve_sim_with_kv_events_and_passes_extra_flags() -> None:
    settings = UpSettings(sim_replicas=3, base_port=9100, kv_events_base_port=6000, vllm_args=("--speed", "0"))
    plans = plan_sims(settings, "tiny")
    assert [p.url for p in plans] == [f"http://127.0.0.1:{9100 + i}" for i in range(3)]
    assert all(p.device == "sim" and p.cpus is None for p in plans)
    argv = plans[2].argv
    assert argv[:4] == (sys.executable, "-m", "dpserve", "sim")
    args = build_parser().parse_args(list(argv[3:]))
    assert (args.port, args.model, args.sim_kv_events, args.sim_speed) == (9102, "tiny", "tcp://127.0.0.1:6002", 0.0)
    with pytest.raises(PlanError):
        plan_sims(UpSettings(sim_replicas=0), "tiny")


def test_router_argv_is_the_public_router_command() -> None:
    router = RouterSettings(policy="round_robin", port=8123, access_log=True)
    settings = UpSettings(router, sim_replicas=2, base_port=9100)
    argv = router_argv(settings, plan_sims(settings, "tiny"), tokenizer="/models/tiny")
    assert argv[:4] == (sys.executable, "-m", "dpserve", "router")
    args = build_parser().parse_args(list(argv[3:]))
    assert args.replicas == ["r0=http://127.0.0.1:9100", "r1=http://127.0.0.1:9101"]
    assert (args.policy, args.port, args.access_log, args.tokenizer) == ("round_robin", 8123, True, "/models/tiny")
    assert args.kv_events == [
        "http://127.0.0.1:9100=tcp://127.0.0.1:5557",
        "http://127.0.0.1:9101=tcp://127.0.0.1:5558",
    ]


def test_router_argv_carries_reliability_flags_and_keys_go_through_the_environment(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    router = RouterSettings(
        api_keys=("secret-user-key",),
        admin_keys=("secret-admin-key",),
        api_key_file=keys,
        max_in_flight=8,
        queue_timeout_s=2.5,
        kv_index_max_entries=5000,
        fail_threshold=4,
        shutdown_grace_s=7.0,
        insecure=True,
    )
    settings = UpSettings(router, sim_replicas=1)
    argv = router_argv(settings, plan_sims(settings, "tiny"))
    assert not any("secret" in arg for arg in argv)  # `ps` shows argv to every user of the machine
    args = build_parser().parse_args(list(argv[3:]))
    assert (args.max_in_flight, args.queue_timeout_s, args.fail_threshold) == (8, 2.5, 4)
    assert args.kv_index_max_entries == 5000
    assert (args.shutdown_grace_s, args.insecure, args.api_key_file) == (7.0, True, keys)
    env = router_env(settings.router)
    assert env == {"DPSERVE_API_KEYS": "secret-user-key", "DPSERVE_ADMIN_KEYS": "secret-admin-key"}
    assert load_settings(RouterSettings, env=env).api_keys == ("secret-user-key",)
    assert router_env(RouterSettings()) == {}


def test_router_argv_leaves_the_policy_default_and_events_to_what_is_known() -> None:
    settings = UpSettings(sim_replicas=1, vllm_args=("--kv-events-config", "{}"))
    args = build_parser().parse_args(list(router_argv(settings, plan_sims(settings, "tiny"))[3:]))
    assert (args.policy, args.kv_events, args.tokenizer) == (None, None, None)
    assert (RouterSettings().routing_policy, RouterSettings().slo_inner_policy) == ("slo", "least_loaded")
    assert RouterSettings(kv_events=("u=tcp://h:1",)).slo_inner_policy == "kv_aware"


def test_the_replicas_batch_limit_reaches_the_router_for_its_scale_signal() -> None:
    """What follows `--` on `dpserve up` is what vLLM (or each sim) runs with: its --max-num-seqs is the
    capacity the routers' signal takes until they see a replica full; a router flag of its own wins."""

    def told(settings: UpSettings) -> int | None:
        argv = router_argv(settings, plan_sims(settings, "tiny"))
        router = load_settings(RouterSettings, _overrides(build_parser().parse_args(list(argv[3:]))), env={})
        return router.replica_max_num_seqs

    assert told(UpSettings(sim_replicas=1, vllm_args=("--max-num-seqs", "4", "--enforce-eager"))) == 4
    assert told(UpSettings(sim_replicas=1, vllm_args=("--max-num-seqs=32",))) == 32
    assert told(UpSettings(sim_replicas=1)) is None  # vLLM's own default differs by device: not guessed
    assert told(UpSettings(sim_replicas=1, vllm_args=("--max-num-seqs", "many"))) is None
    own = UpSettings(RouterSettings(replica_max_num_seqs=8), sim_replicas=1, vllm_args=("--max-num-seqs", "4"))
    assert told(own) == 8


def test_busy_ports_finds_a_port_something_listens_on() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        assert busy_ports([taken]) == [taken]
    assert busy_ports([taken]) == []


def test_gpu_health_settings_reach_the_router_as_flags_and_read_back_the_same() -> None:
    router = RouterSettings(
        gpu_agents=("http://10.0.0.5:9400", "http://10.0.0.6:9400"),
        gpu_health=False,
        gpu_throttle_reasons=("hw_slowdown", "sw_power_cap"),
        gpu_ignored_xids=("13",),
        gpu_event_hold_s=60.0,
        gpu_degrade_after_s=5.0,
        gpu_recover_after_s=90.0,
        gpu_pcie_busy_utilization=0.25,
    )
    settings = UpSettings(router, sim_replicas=1)
    argv = router_argv(settings, plan_sims(settings, "tiny"))
    assert argv[3] == "router"
    read = load_settings(RouterSettings, _overrides(build_parser().parse_args(list(argv[3:]))), env={})
    fields = (
        "gpu_agents",
        "gpu_health",
        "gpu_throttle_reasons",
        "gpu_ignored_xids",
        "gpu_event_hold_s",
        "gpu_degrade_after_s",
        "gpu_recover_after_s",
        "gpu_pcie_busy_utilization",
    )
    assert {name: getattr(read, name) for name in fields} == {name: getattr(router, name) for name in fields}
    defaults = router_argv(UpSettings(sim_replicas=1), plan_sims(UpSettings(sim_replicas=1), "tiny"))
    assert not any(arg.startswith(("--gpu-", "--no-gpu")) for arg in defaults)


def test_one_router_is_planned_as_before() -> None:
    settings = UpSettings(RouterSettings(port=8123), sim_replicas=2, base_port=9100)
    plans = plan_sims(settings, "tiny")
    (router,) = plan_routers(settings, 1, plans, tokenizer="/models/tiny")
    assert (router.name, router.port, router.url) == ("router", 8123, "http://127.0.0.1:8123")
    assert router.argv == router_argv(settings, plans, tokenizer="/models/tiny")
    assert "--peer" not in router.argv


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_several_routers_listen_on_the_next_ports_and_are_each_others_peers(host: str) -> None:
    router = RouterSettings(host=host, port=8200, policy="prefix", workers=2, peers=("http://10.0.0.9:8000",))
    settings = UpSettings(router, sim_replicas=2, base_port=9100)
    plans = plan_sims(settings, "tiny")
    routers = plan_routers(settings, 3, plans)
    assert [r.name for r in routers] == ["router", "router-2", "router-3"]
    assert [r.port for r in routers] == [8200, 8201, 8202]
    urls = [f"http://127.0.0.1:{port}" for port in (8200, 8201, 8202)]  # a wildcard is reached on loopback
    assert [r.url for r in routers] == urls
    for plan, url in zip(routers, urls, strict=True):
        args = build_parser().parse_args(list(plan.argv[3:]))
        assert args.port == int(url.rsplit(":", 1)[1]) and args.host == host
        # The user's own peers, then every other router here.
        assert args.peers == ["http://10.0.0.9:8000", *(other for other in urls if other != url)]
        # Otherwise the one router's command: same replicas, policy and workers.
        assert args.replicas == [f"{p.id}={p.url}" for p in plans] and (args.policy, args.workers) == ("prefix", 2)


def test_router_plans_refuse_no_router_and_ports_a_replica_takes() -> None:
    settings = UpSettings(RouterSettings(port=9098), sim_replicas=2, base_port=9100)
    plans = plan_sims(settings, "tiny")
    with pytest.raises(PlanError, match="--routers must be at least 1"):
        plan_routers(settings, 0, plans)
    assert len(plan_routers(settings, 2, plans)) == 2
    with pytest.raises(PlanError, match=r"router port\(s\) 9100 are also replica"):
        plan_routers(settings, 3, plans)


def test_routers_come_from_the_flag_or_the_environment() -> None:
    args = build_parser().parse_args(["up", "--sim", "2", "--routers", "3", "--workers", "2"])
    assert load_settings(UpSettings, _overrides(args), env={}).routers == 3
    assert load_settings(UpSettings, _overrides(args), env={"DPSERVE_ROUTERS": "5"}).routers == 3
    plain = _overrides(build_parser().parse_args(["up", "--sim", "2"]))
    assert load_settings(UpSettings, plain, env={"DPSERVE_ROUTERS": "5"}).routers == 5
    assert load_settings(UpSettings, plain, env={}).routers == 1
    # --workers is a router flag of `dpserve up` too, passed to every router.
    settings = load_settings(UpSettings, _overrides(args), env={})
    routers = plan_routers(settings, 2, plan_sims(settings, "tiny"))
    assert all(r.argv[r.argv.index("--workers") + 1] == "2" for r in routers)


def _launcher(settings: UpSettings, routers: int, tmp_path: Path) -> Launcher:
    plans = plan_sims(settings, "tiny")
    return Launcher(settings, plans, plan_routers(settings, routers, plans), tmp_path)


def test_launcher_lists_every_router_and_says_where_they_serve(tmp_path: Path) -> None:
    settings = UpSettings(RouterSettings(port=8300), sim_replicas=1, base_port=9100)
    one = _launcher(settings, 1, tmp_path)
    assert one.ready_message() == "dpserve: router ready at http://127.0.0.1:8300/v1 (Ctrl-C stops everything)"
    assert [line.split()[0] for line in one.table().splitlines()] == ["REPLICA", "r0", "router"]
    two = _launcher(settings, 2, tmp_path)
    assert two.ready_message() == (
        "dpserve: 2 routers ready at http://127.0.0.1:8300/v1, http://127.0.0.1:8301/v1 (Ctrl-C stops everything)"
    )
    rows = [line.split() for line in two.table().splitlines()[1:]]
    assert [row[:3] for row in rows[1:]] == [
        ["router", "http://127.0.0.1:8300", "policy=kv_aware"],
        ["router-2", "http://127.0.0.1:8301", "policy=kv_aware"],
    ]
    # Each router is a supervised child of its own, started, probed and restarted as the one router is.
    assert [proc.name for proc in two.routers] == ["router", "router-2"]
    assert [proc.argv for proc in two.routers] == [plan.argv for plan in two.router_plans]


def test_launcher_refuses_a_busy_port_of_any_router(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def must_not_start(*args: object) -> None:
        raise AssertionError("dpserve up went on to start its children")

    monkeypatch.setattr("dpserve.up.launcher.Launcher", must_not_start)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        settings = load_settings(UpSettings, {"port": taken - 1, "sim_replicas": 1, "base_port": 1024}, env={})
        assert run_launcher(settings, routers=2) == 2  # the second router's port: refused before anything starts
        err = capsys.readouterr().err
        assert "already in use" in err and str(taken) in err.split("already in use")[0]
    assert run_launcher(settings, routers=0) == 2
    assert "--routers must be at least 1" in capsys.readouterr().err


def test_flow_control_settings_reach_the_router_and_priority_scheduling_the_replicas() -> None:
    args = build_parser().parse_args(
        ["up", "--flow-control", "off", "--tenant", "acme:weight=2,rpm=60", "--batch-reserve", "0.2", "--vllm-priority"]
    )
    settings = load_settings(UpSettings, _overrides(args), env={})
    assert settings.router.flow_control is False and settings.router.tenants == ("acme:weight=2,rpm=60",)
    plans = plan_replicas(settings, "/m", "tiny", 0, [0, 1])
    argv = router_argv(settings, plans)
    assert argv[argv.index("--flow-control") + 1] == "off"
    assert argv[argv.index("--tenant") + 1] == "acme:weight=2,rpm=60"
    assert argv[argv.index("--batch-reserve") + 1] == "0.2" and "--vllm-priority" in argv
    replica = plans[0].argv
    assert replica[replica.index("--scheduling-policy") + 1] == "priority"
    # Tenants' rules hold commas, so the environment separates them by spaces or `;`.
    from_env = load_settings(RouterSettings, {}, env={"DPSERVE_TENANTS": "a:rpm=1,tpm=2;b:weight=3"})
    assert from_env.tenants == ("a:rpm=1,tpm=2", "b:weight=3")


def test_the_routers_trace_endpoint_reaches_the_replicas_unless_they_name_their_own() -> None:
    endpoint = "http://127.0.0.1:4317"
    for vllm_args, expected in (((), endpoint), (("--otlp-traces-endpoint", "http://other:4317"), None)):
        args = build_parser().parse_args(["up", "--otlp-traces-endpoint", endpoint])
        overrides = {**_overrides(args), "vllm_args": vllm_args}  # what follows `--`
        settings = load_settings(UpSettings, overrides, env={})
        plans = plan_replicas(settings, "/m", "tiny", 0, [0, 1])
        router = router_argv(settings, plans)
        assert router[router.index("--otlp-traces-endpoint") + 1] == endpoint
        replica = plans[0].argv
        assert replica.count("--otlp-traces-endpoint") == 1
        assert expected is None or replica[replica.index("--otlp-traces-endpoint") + 1] == expected
    untraced = load_settings(UpSettings, _overrides(build_parser().parse_args(["up"])), env={})
    assert "--otlp-traces-endpoint" not in plan_replicas(untraced, "/m", "tiny", 0, [0])[0].argv


def _lora_flags(argv: tuple[str, ...]) -> tuple[str, ...]:
    """vLLM's LoRA flags in a replica's argv, with their values, as dpserve writes them."""
    if "--enable-lora" not in argv:
        return ()
    start = argv.index("--enable-lora")
    return argv[start : start + 5]


def test_no_lora_unless_asked_for() -> None:
    for gpus in (0, 2):
        for plan in plan_replicas(UpSettings(), "/m", "tiny", gpus, [0, 1]):
            assert _lora_flags(plan.argv) == () and "--max-loras" not in plan.argv
            assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plan.env
    argv = router_argv(UpSettings(sim_replicas=1), plan_sims(UpSettings(sim_replicas=1), "tiny"))
    assert not any(arg.startswith("--lora") for arg in argv)


@pytest.mark.parametrize("gpus", [0, 2])
def test_lora_settings_reach_the_router_and_the_replicas(
    gpus: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    (tmp_path / "chat").mkdir()
    monkeypatch.chdir(tmp_path)
    flags = ["up", "--lora-dir", "adapters", "--lora", "chat=chat", "--lora", "hub=org/adapter"]
    flags += ["--lora-affinity", "off", "--max-loras", "4", "--max-lora-rank", "32"]
    settings = load_settings(UpSettings, _overrides(build_parser().parse_args(flags)), env={})
    plans = plan_replicas(settings, "/m", "tiny", gpus, [0, 1])
    for plan in plans:
        assert _lora_flags(plan.argv) == ("--enable-lora", "--max-loras", "4", "--max-lora-rank", "32")
        # Adapters are loaded at run time by the router: the replicas allow it and are given none up front.
        assert plan.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
        assert not any(arg.startswith("--lora-modules") for arg in plan.argv)
    argv = router_argv(settings, plans)
    read = load_settings(RouterSettings, _overrides(build_parser().parse_args(list(argv[3:]))), env={})
    # Local replicas see this host's files: absolute paths, so the router and replicas agree whatever their cwd.
    assert read.lora_dir == str(tmp_path / "adapters")
    assert read.lora_adapters == {"chat": str(tmp_path / "chat"), "hub": "org/adapter"}
    assert read.lora_affinity is False


def test_enable_lora_alone_uses_vllms_limits_and_extra_vllm_flags_win() -> None:
    argv = plan_replicas(UpSettings(enable_lora=True), "/m", "tiny", 0, [0, 1])[0].argv
    assert _lora_flags(argv) == ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")
    extra = ("--max-loras=8", "--max-lora-rank", "64")
    argv = plan_replicas(UpSettings(enable_lora=True, vllm_args=extra), "/m", "tiny", 0, [0, 1])[0].argv
    assert argv[-3:] == extra and argv.count("--max-lora-rank") == 1 and "--max-loras" not in argv


def test_launcher_refuses_a_lora_dir_that_is_not_here(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    settings = UpSettings(RouterSettings(lora_dir=str(missing)), sim_replicas=1, base_port=1024)
    assert run_launcher(settings) == 2
    assert f"--lora-dir {missing}: no such folder" in capsys.readouterr().err


def test_launcher_says_plainly_when_vllm_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seen on a GPU machine without vLLM: the replica used to die with a bare ModuleNotFoundError."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        "dpserve.up.launcher.importlib.util.find_spec",
        lambda name, *args: None if name == "vllm" else real_find_spec(name, *args),
    )
    assert run_launcher(UpSettings(base_port=1024)) == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "dpserve[" in err and "--sim" in err
    # Simulated replicas need no engine.
    assert _plan(UpSettings(sim_replicas=1))[0][0].device == "sim"


def _topology(name: str) -> GpuTopology:
    nvml = gpus_of_topology(name)
    nvml.nvmlInit()
    return read_topology_with(nvml, len(nvml.gpus))


def test_tensor_parallel_replicas_take_nvlinked_gpu_groups_and_the_router_hears_of_them() -> None:
    settings = UpSettings(tensor_parallel_size=2)
    plans = plan_replicas(settings, "org/model-70b", None, _topology("nvlink-bridges-8"), [0, 1])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0,2", "1,3", "4,6", "5,7"]
    assert [p.gpus for p in plans] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert [p.device for p in plans] == ["cuda:0,2", "cuda:1,3", "cuda:4,6", "cuda:5,7"]
    for plan in plans:
        assert plan.argv[plan.argv.index("--tensor-parallel-size") + 1] == "2"
        assert plan.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    args = build_parser().parse_args(list(router_argv(settings, plans)[3:]))
    assert args.replicas == [
        f"r{i}=http://127.0.0.1:{8100 + i}@gpu={gpus}" for i, gpus in enumerate(["0,2", "1,3", "4,6", "5,7"])
    ]
    assert grouping_line(_topology("nvlink-bridges-8"), plans) == (
        "dpserve: GPUs grouped by NVML topology: r0 0,2 (NVLink); r1 1,3 (NVLink); r2 4,6 (NVLink); r3 5,7 (NVLink)"
    )
    # One GPU per replica, as before: no flag for vLLM.
    assert "--tensor-parallel-size" not in plan_replicas(UpSettings(), "m", None, 8, [0])[0].argv


def test_fewer_tensor_parallel_replicas_than_groups_take_the_best_linked() -> None:
    # Sockets interleaved: pairs share a PCIe switch. Four of them, --replicas 2 takes the first two.
    topology = _topology("pcie-interleaved-8")
    plans = plan_replicas(UpSettings(tensor_parallel_size=4, num_replicas=1), "m", None, topology, [0])
    assert [p.gpus for p in plans] == [(0, 2, 4, 6)]
    rows = [[0 if a == b else 6 for b in range(4)] for a in range(4)]
    rows[2][3] = rows[3][2] = 0  # only 2-3 is NVLinked
    plans = plan_replicas(
        UpSettings(tensor_parallel_size=2, num_replicas=1),
        "m",
        None,
        GpuTopology(tuple(tuple(row) for row in rows)),
        [0],
    )
    assert [p.gpus for p in plans] == [(2, 3)]
    with pytest.raises(
        PlanError,
        match="--replicas 3 asks for more replicas than the 4 GPUs found: at --tensor-parallel-size 2 they make 2",
    ):
        plan_replicas(UpSettings(tensor_parallel_size=2, num_replicas=3), "m", None, 4, [0])


def test_tensor_parallel_size_not_dividing_the_gpus_or_given_after_the_dashes_is_refused() -> None:
    with pytest.raises(PlanError, match=r"--tensor-parallel-size 3 does not divide the 8 GPU\(s\) found"):
        plan_replicas(UpSettings(tensor_parallel_size=3), "m", None, _topology("nvswitch-8"), [0])
    for extra in (("--tensor-parallel-size", "2"), ("-tp=2",)):
        with pytest.raises(PlanError, match="give --tensor-parallel-size to dpserve up itself"):
            plan_replicas(UpSettings(vllm_args=extra), "m", None, 8, [0])
    with pytest.raises(ValueError, match="at least 1 GPU per replica"):
        UpSettings(tensor_parallel_size=0)


def test_cpu_tensor_parallel_ranks_get_a_core_set_each() -> None:
    settings = UpSettings(tensor_parallel_size=2, num_replicas=1)
    (plan,) = plan_replicas(settings, "/m", "tiny", 0, [0, 1])
    assert plan.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert plan.cpus == (0, 1) and plan.device == "cpu:0|1" and plan.gpus == ()
    assert plan.argv[plan.argv.index("--tensor-parallel-size") + 1] == "2"
    assert plan.router_target.gpu is None
    plans = plan_replicas(UpSettings(tensor_parallel_size=2), "/m", "tiny", 0, range(8))
    assert [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in plans] == ["0,1|2,3", "4,5|6,7"]
    assert [p.cpus for p in plans] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_tensor_parallel_size_comes_from_the_flag_or_the_environment() -> None:
    args = build_parser().parse_args(["up", "--tensor-parallel-size", "2"])
    assert load_settings(UpSettings, _overrides(args), env={}).tensor_parallel_size == 2
    args = build_parser().parse_args(["up"])
    settings = load_settings(UpSettings, _overrides(args), env={"DPSERVE_TENSOR_PARALLEL_SIZE": "4"})
    assert settings.tensor_parallel_size == 4
