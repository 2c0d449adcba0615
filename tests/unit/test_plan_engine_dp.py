"""`dpserve up --engine-dp`: one vLLM data-parallel server per host, its engines routed one by one."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence

import pytest

from dpserve.cli import _overrides, build_parser
from dpserve.config import RouterSettings, UpSettings, load_settings
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.up.engine_dp import engine_core_sets, pin_engine_processes, plan_dp_server, plan_dp_sim
from dpserve.up.launcher import _plan, run_launcher
from dpserve.up.plan import PlanError, ReplicaPlan, plan_replicas, plan_routers, router_argv


def _router_args(settings: UpSettings, plans: Sequence[ReplicaPlan]) -> argparse.Namespace:
    return build_parser().parse_args(list(router_argv(settings, plans)[3:]))


def test_the_flag_and_its_variable_turn_it_on() -> None:
    settings = load_settings(UpSettings, _overrides(build_parser().parse_args(["up", "--engine-dp"])), env={})
    assert settings.engine_dp is True
    assert load_settings(UpSettings, {}, env={"DPSERVE_ENGINE_DP": "1"}).engine_dp is True
    assert UpSettings().engine_dp is False


def test_cpu_plan_is_one_server_whose_engines_each_get_the_cores_a_replica_would() -> None:
    settings = UpSettings(base_port=9100, kv_events_base_port=6000)
    (plan,) = plan_dp_server(settings, "/m", "tiny", 0, [0, 1])
    singles = plan_replicas(settings, "/m", "tiny", 0, [0, 1])
    assert (plan.id, plan.url, plan.engines) == ("r0", "http://127.0.0.1:9100", 2)
    # Engine r bound to the r-th core set: the cores replica r would have had on its own.
    assert (
        plan.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" == "|".join(p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in singles)
    )
    assert plan.cpus == (0, 1) and plan.device == "cpu:0|1"
    assert plan.env["VLLM_CPU_KVCACHE_SPACE"] == singles[0].env["VLLM_CPU_KVCACHE_SPACE"]  # the cache is per engine
    argv = plan.argv
    assert argv[:3] == (sys.executable, "-m", "vllm.entrypoints.openai.api_server")
    assert argv[argv.index("--data-parallel-size") + 1] == "2"
    # Its RPC port is the one a second replica would have had: vLLM's default would clash with another server.
    assert argv[argv.index("--data-parallel-rpc-port") + 1] == "9101"
    assert json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:6000"
    assert "--enable-prefix-caching" in argv and argv[argv.index("--served-model-name") + 1] == "tiny"
    # It binds its port, each engine's KV-event port (6000 + rank) and its RPC port.
    assert plan.ports == (9100, 6000, 6001, 9101)
    (bigger,) = plan_dp_server(UpSettings(num_replicas=2), "/m", None, 0, range(4))
    assert bigger.env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3" and bigger.cpus == (0, 1, 2, 3)


def test_the_router_is_told_of_the_server_and_routes_each_engine() -> None:
    settings = UpSettings(base_port=9100, kv_events_base_port=6000)
    plans = plan_dp_server(settings, "/m", "tiny", 0, [0, 1])
    args = _router_args(settings, plans)
    assert args.replicas == ["r0=http://127.0.0.1:9100@dp=2"]
    # One endpoint for the server: engine r's events are read at its port + r.
    assert args.kv_events == ["http://127.0.0.1:9100=tcp://127.0.0.1:6000"]
    assert args.policy is None  # kv_aware by default: the events are known
    registry = ReplicaRegistry(args.replicas)
    assert [(r.id, r.url, r.rank) for r in registry] == [
        ("r0:dp0", "http://127.0.0.1:9100", 0),
        ("r0:dp1", "http://127.0.0.1:9100", 1),
    ]


def test_gpu_plan_gives_the_server_every_gpu_and_each_engine_its_own() -> None:
    settings = UpSettings(RouterSettings(gpu_interval_s=0.5))
    (plan,) = plan_dp_server(settings, "org/model", None, 4, [0, 1])
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and plan.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert (plan.device, plan.cpus, plan.engines) == ("cuda:0,1,2,3", None, 4)
    assert plan.argv[plan.argv.index("--data-parallel-size") + 1] == "4"
    args = _router_args(settings, [plan])
    assert args.replicas == ["r0=http://127.0.0.1:8100@gpu=0,1,2,3@dp=4"]
    registry = ReplicaRegistry(args.replicas)
    assert [(r.id, r.gpu_hint) for r in registry] == [(f"r0:dp{i}", (str(i),)) for i in range(4)]
    (two,) = plan_dp_server(UpSettings(num_replicas=2), "org/model", None, 4, [0])
    assert two.env["CUDA_VISIBLE_DEVICES"] == "0,1" and two.engines == 2
    with pytest.raises(PlanError, match="more engines than the 4 GPUs"):
        plan_dp_server(UpSettings(num_replicas=5), "org/model", None, 4, [0])


def test_vllm_flags_after_the_dashes_pass_through_but_the_engine_count_is_the_plans() -> None:
    (plan,) = plan_dp_server(UpSettings(vllm_args=("--seed", "3", "--max-model-len", "512")), "/m", None, 0, [0, 1])
    assert plan.argv[-4:] == ("--seed", "3", "--max-model-len", "512") and plan.argv.count("--max-model-len") == 1
    for flag in ("--data-parallel-size", "--data-parallel-rpc-port=7000"):
        with pytest.raises(PlanError, match="--engine-dp sets --data-parallel-size"):
            plan_dp_server(UpSettings(vllm_args=(flag, "2")), "/m", None, 0, [0, 1])


def test_sims_become_one_data_parallel_sim() -> None:
    settings = UpSettings(sim_replicas=3, engine_dp=True, base_port=9100, kv_events_base_port=6000)
    (plan,) = plan_dp_sim(settings, "tiny")
    args = build_parser().parse_args(list(plan.argv[3:]))
    assert (args.port, args.sim_data_parallel_size, args.sim_kv_events) == (9100, 3, "tcp://127.0.0.1:6000")
    assert plan.ports == (9100, 6000, 6001, 6002)
    assert _router_args(settings, [plan]).replicas == ["r0=http://127.0.0.1:9100@dp=3"]
    assert [p.engines for p in _plan(settings)[0]] == [3]
    assert [p.engines for p in _plan(UpSettings(sim_replicas=3))[0]] == [1, 1, 1]
    with pytest.raises(PlanError):
        plan_dp_sim(UpSettings(sim_replicas=0, engine_dp=True), "tiny")


def test_a_router_port_on_an_engines_kv_port_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    settings = UpSettings(RouterSettings(port=6001), sim_replicas=2, engine_dp=True, kv_events_base_port=6000)
    with pytest.raises(PlanError, match="6001"):
        plan_routers(settings, 1, plan_dp_sim(settings, "tiny"))
    with socket.socket() as listener:  # engine 1's KV-event port is taken: refused before anything starts
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        settings = UpSettings(sim_replicas=2, engine_dp=True, base_port=1024, kv_events_base_port=taken - 1)
        assert run_launcher(settings) == 2
        assert str(taken) in capsys.readouterr().err


def test_engine_dp_with_tensor_parallel_ranks_is_refused() -> None:
    with pytest.raises(PlanError, match="--engine-dp with --tensor-parallel-size"):
        plan_dp_server(UpSettings(tensor_parallel_size=2), "/m", None, 0, [0, 1])


def test_engine_core_sets_come_from_the_servers_bind() -> None:
    (cpu,) = plan_dp_server(UpSettings(), "/m", None, 0, range(4))
    assert engine_core_sets(cpu) == [(0, 1), (2, 3)]
    (gpu,) = plan_dp_server(UpSettings(), "/m", None, 2, [0, 1])
    assert engine_core_sets(gpu) == []
    assert engine_core_sets(plan_replicas(UpSettings(), "/m", None, 0, [0, 1])[0]) == []


ENGINE_LIKE = """
import setproctitle, sys, threading, time
setproctitle.setproctitle("VLLM::EngineCore_DP" + sys.argv[1])
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_engine_processes_are_pinned_to_their_engines_cores_every_thread() -> None:
    """vLLM binds only an engine's model worker to its cores; the engine process, titled as vLLM titles it,
    is found under the server's process and pinned, all its threads."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    # Children of this process, which stands for the server: the engines are found under it.
    engines = [
        subprocess.Popen([sys.executable, "-c", ENGINE_LIKE, str(rank)], stdout=subprocess.PIPE) for rank in (0, 1)
    ]
    try:
        for engine in engines:
            assert engine.stdout is not None and engine.stdout.readline() == b"ready\n"
        pinned = pin_engine_processes(os.getpid(), [(cores[0],), (cores[1],)])
        assert pinned == {engines[0].pid: (cores[0],), engines[1].pid: (cores[1],)}
        for rank, engine in enumerate(engines):
            threads = os.listdir(f"/proc/{engine.pid}/task")
            assert len(threads) >= 2
            assert all(os.sched_getaffinity(int(tid)) == {cores[rank]} for tid in threads)
        assert pin_engine_processes(engines[0].pid, [(0,)]) == {}  # no engine under it: nothing to pin
    finally:
        for engine in engines:
            engine.kill()
            engine.wait()
