#!/usr/bin/env bash
# The router's throughput per core on the lent GPU machine (one H100, 16 CPUs, no network), and the GPU tests:
#
#     bash benchmarks/device_cores.sh            # from the checkout's root, with `.device` carried
#
# `.device` (ignored through .git/info/exclude) holds what that machine lacks: whl/ (the wheels of the
# router's, the benchmark's and the GPU tests' imports that its image does not have, for CPython 3.12),
# bin/wrk with lib/libluajit-5.1.so.2, and lib-ssl/ (libssl3, used only when the image lacks it).
# Steps, each timed and none stopping the others; all within BUDGET_S seconds (350):
#   1. the wheels installed into /tmp/site (--target), wrk and vllm-router put on PATH;
#   2. $OUT/host.txt: CPUs, GPU, Python, and where each carried module was imported from;
#   3. $OUT/gpu-tests.txt: `pytest -m gpu tests/gpu` (at most GPU_TIMEOUT_S, 120), and $OUT/gpu-status.json;
#   4. `dpserve bench overhead` for each C in CORES ("1 8 2 4"): the routers on CPUs 0..C-1 (taskset), dpserve
#      with --workers C against vllm-router on the same C cores, JSON and SSE, CONNECTIONS (128) over BACKENDS
#      (4) fast backends, ceil(C/2) wrk per router URL; the backends and wrk on the other CPUs. Then `direct`
#      (the backends alone, on the CPUs the widest C left them): their ceiling. Each C gets ROUNDS (2) rounds
#      of DURATION (2) s runs when the budget left allows, else 1, else it is skipped (said so).
#      $OUT/cores.txt: every run's output; $OUT/cores-summary.txt: req/s per C, per router core, the ratio
#      dpserve/vllm-router and the scaling from C=1; $OUT/cores.tar.gz: every overhead.csv and overhead.png.
#   5. $OUT/summary.txt: one line per step with its exit status; this script itself exits 0.
# DEVICE_DRY=1 rehearses on a small machine: C=1 only, 1 round, 1 backend, 32 connections.
# Knobs (environment): CORES, ROUNDS, DURATION and WARMUP (1; whole seconds), BACKENDS, CONNECTIONS, LOADGENS,
# POLICIES (round_robin), TARGETS (dpserve,vllm-router), BUDGET_S, GPU_TIMEOUT_S, DIRECT (1), PYTHON (python3),
# DEVICE_DIR (.device), DEVICE_WHEELS (.device/whl), DEVICE_SITE (/tmp/site), OUT ($OUT, else /tmp/device-out).

set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
START=$SECONDS

if [ "${DEVICE_DRY:-0}" = 1 ]; then
    : "${CORES:=1}" "${ROUNDS:=1}" "${DURATION:=2}" "${BACKENDS:=1}" "${CONNECTIONS:=32}" "${BUDGET_S:=150}"
fi
OUT=${OUT:-/tmp/device-out}
DEV=${DEVICE_DIR:-$ROOT/.device}
WHEELS=${DEVICE_WHEELS:-$DEV/whl}
SITE=${DEVICE_SITE:-/tmp/site}
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-350}
GPU_TIMEOUT_S=${GPU_TIMEOUT_S:-120}
CORES=${CORES:-1 8 2 4}
ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-2}
WARMUP=${WARMUP:-1}
BACKENDS=${BACKENDS:-4}
CONNECTIONS=${CONNECTIONS:-128}
POLICIES=${POLICIES:-round_robin}
TARGETS=${TARGETS:-dpserve,vllm-router}
DIRECT=${DIRECT:-1}
WORK=/tmp/device-cores
RESERVE_S=15 # kept for the summary and the tarball

export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
: >"$OUT/summary.txt"

stamp() { echo "[$(date +%H:%M:%S) +$((SECONDS - START))s] $*"; }
left() { echo $((BUDGET_S - (SECONDS - START))); }
note() { # one line of the summary, also printed
    echo "$*" >>"$OUT/summary.txt"
    stamp "$*"
}

# A step's command under timeout, which runs it in a process group of its own and at LIMIT seconds signals the
# whole group (TERM, then KILL 10 s later): what the step started goes with it. Its output is appended to LOG;
# returns the command's exit status (124 when stopped). What it left running afterwards is stopped too.
ACTIVE=
run_limited() {
    local limit=$1 log=$2 pid rc
    shift 2
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1 </dev/null &
    pid=$!
    ACTIVE=$pid
    wait "$pid"
    rc=$?
    kill -TERM -- "-$pid" 2>/dev/null && sleep 1 && kill -KILL -- "-$pid" 2>/dev/null
    ACTIVE=
    return $rc
}
trap '[ -n "$ACTIVE" ] && kill -KILL -- "-$ACTIVE" 2>/dev/null' EXIT
trap 'exit 143' TERM INT

# -- 1. the carried wheels and programs ----------------------------------------------------------------------
stamp "1. install: $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l) wheels from $WHEELS into $SITE"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl >"$WORK/pip.txt" 2>&1
rc=$?
export PYTHONPATH=$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$DEV/bin:$SITE/bin:$PATH
export LD_LIBRARY_PATH=$DEV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if ldd "$DEV/bin/wrk" 2>/dev/null | grep -q "not found"; then
    export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$DEV/lib-ssl
fi
WRK_OK=0
wrk -v 2>&1 | grep -q "^wrk " && WRK_OK=1
VLLM_ROUTER=$(command -v vllm-router || echo "not found")
note "1. install: pip rc=$rc; wrk $([ $WRK_OK = 1 ] && echo runs || echo "DOES NOT RUN"); vllm-router: $VLLM_ROUTER"
[ $rc = 0 ] || tail -5 "$WORK/pip.txt"

# -- 2. the host --------------------------------------------------------------------------------------------
stamp "2. host"
{
    echo "## date: $(date -u +%FT%TZ)  uname: $(uname -srm)"
    echo "## nproc: $(nproc)"
    lscpu | head -20
    echo "## lscpu -e"
    lscpu -e 2>&1 | head -40
    echo "## nvidia-smi -L"
    nvidia-smi -L 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    echo "## free -g"
    free -g
    echo "## load: $(cat /proc/loadavg)"
    echo "## python: $(command -v "$PYTHON") $("$PYTHON" -VV 2>&1)"
    echo "## PYTHONPATH=$PYTHONPATH"
    echo "## LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "## pip install (rc=$rc)"
    cat "$WORK/pip.txt"
    echo "## wrk: $(command -v wrk)"
    wrk -v 2>&1 | head -2
    ldd "$(command -v wrk)" 2>&1
    echo "## vllm-router: $VLLM_ROUTER"
    head -1 "$VLLM_ROUTER" 2>/dev/null
    echo "## imported (module version file)"
    "$PYTHON" - <<'EOF' 2>&1
import importlib
import importlib.metadata as md
import sys

print(sys.executable, sys.version.split()[0])
modules = {
    "fastapi": "fastapi", "starlette": "starlette", "pydantic": "pydantic", "pydantic_core": "pydantic_core",
    "annotated_types": "annotated-types", "typing_inspection": "typing-inspection",
    "typing_extensions": "typing_extensions", "uvicorn": "uvicorn", "httptools": "httptools", "orjson": "orjson",
    "msgspec": "msgspec", "zmq": "pyzmq", "dns": "dnspython", "python_multipart": "python-multipart",
    "setproctitle": "setproctitle", "vllm_router": "vllm-router", "vllm_router_rs": "vllm-router",
    "pytest_asyncio": "pytest-asyncio", "pytest": "pytest", "uvloop": "uvloop", "aiohttp": "aiohttp",
    "anyio": "anyio", "httpx": "httpx", "h11": "h11", "click": "click", "psutil": "psutil",
    "prometheus_client": "prometheus-client", "pynvml": "nvidia-ml-py", "tokenizers": "tokenizers",
    "jinja2": "jinja2", "yaml": "pyyaml", "matplotlib": "matplotlib", "torch": "torch",
    "dpserve.router.serve": None, "benchmarks.overhead": None, "benchmarks.fast_backend": None,
}
for name, dist in modules.items():
    try:
        module = importlib.import_module(name)
        version = md.version(dist) if dist else "checkout"
        print(f"ok      {name:22} {version:14} {getattr(module, '__file__', '')}")
    except Exception as exc:  # noqa: BLE001 - every failure is the finding
        print(f"FAILED  {name:22} {type(exc).__name__}: {exc}")
EOF
} >"$OUT/host.txt" 2>&1
FAILED_IMPORTS=$(grep -c "^FAILED" "$OUT/host.txt")
note "2. host: $(nproc) CPUs; $(nvidia-smi -L 2>/dev/null | head -1 | cut -c1-60 || true); imports failed: $FAILED_IMPORTS"
grep "^FAILED" "$OUT/host.txt"

# -- 3. the GPU tests ---------------------------------------------------------------------------------------
stamp "3. gpu tests (at most ${GPU_TIMEOUT_S}s)"
export DPSERVE_GPU_STATUS_OUT=$OUT/gpu-status.json # the router's /status in the GPU test
GPU_TESTS=("$PYTHON" -m pytest -m gpu tests/gpu -v -rs -p no:cacheprovider -o addopts="")
step_start=$SECONDS
run_limited "$GPU_TIMEOUT_S" "$OUT/gpu-tests.txt" "${GPU_TESTS[@]}"
rc=$?
if [ $rc = 3 ] || [ $rc = 4 ] && grep -q "pytest_asyncio" "$OUT/gpu-tests.txt"; then
    # The carried pytest-asyncio (1.5, pytest >= 8.4) did not load into this pytest: again without it.
    echo "#### pytest-asyncio did not load (rc=$rc): again with -p no:asyncio" >>"$OUT/gpu-tests.txt"
    again=$((GPU_TIMEOUT_S - (SECONDS - step_start)))
    [ $again -lt 10 ] && again=10
    run_limited $again "$OUT/gpu-tests.txt" "${GPU_TESTS[@]}" -p no:asyncio
    rc=$?
fi
note "3. gpu tests: rc=$rc in $((SECONDS - step_start))s; $(grep -E "^=+ .*(passed|failed|skipped|error|no tests).* =+$" "$OUT/gpu-tests.txt" | tail -1)"
tail -25 "$OUT/gpu-tests.txt"

# -- 4. the cores -------------------------------------------------------------------------------------------
# Seconds a C takes with R rounds and T targets (each dpserve policy, each other router): every target measured
# 4 times (JSON and SSE, at CONNECTIONS and at 1 connection) after its warm-up and started twice (about 5 s),
# the backends started once. 30 s here for C=1 with 2-s runs and 2 targets, against 38 estimated.
TARGET_COUNT=0
for target in ${TARGETS//,/ }; do
    if [ "$target" = dpserve ]; then
        TARGET_COUNT=$((TARGET_COUNT + $(echo "${POLICIES//,/ }" | wc -w)))
    else
        TARGET_COUNT=$((TARGET_COUNT + 1))
    fi
done
estimate() { echo $((4 + $1 * ${2:-$TARGET_COUNT} * (4 * (WARMUP + DURATION) + 5))); }
DIRECT_S=0
[ "$DIRECT" = 1 ] && DIRECT_S=$(estimate 1 1)
# --loadgens (several wrk per router URL) is newer than --router-cpus: without it, one wrk as before.
LOADGENS_OK=0
"$PYTHON" -m dpserve bench overhead --help 2>/dev/null | grep -q -- --loadgens && LOADGENS_OK=1

bench() { # C ROUNDS TARGETS OUTDIR LIMIT
    local cores=$1 rounds=$2 targets=$3 out=$4 limit=$5 loadgens cpus extra=()
    loadgens=${LOADGENS:-$(((cores + 1) / 2))}
    [ "$targets" = direct ] && loadgens=1 # one wrk per backend already, on the backends' CPUs
    [ "$LOADGENS_OK" = 1 ] && extra=(--loadgens "$loadgens") || loadgens=1
    cpus=0
    [ "$cores" -gt 1 ] && cpus=0-$((cores - 1))
    {
        echo
        echo "######## C=$cores $targets: routers on CPUs $cpus; $rounds round(s); $loadgens wrk per router URL;" \
            "limit ${limit}s ########"
    } >>"$OUT/cores.txt"
    run_limited "$limit" "$OUT/cores.txt" "$PYTHON" -m dpserve bench overhead --backends "$BACKENDS" \
        --router-cpus "$cpus" --rounds "$rounds" --targets "$targets" --dpserve-policies "$POLICIES" \
        --router-arg="--workers=$cores" --duration "$DURATION" --warmup "$WARMUP" --connections "$CONNECTIONS" \
        "${extra[@]}" --loadgen wrk --skip-decision --out "$out"
}

# In CORES' order (the extremes first), each C gets ROUNDS rounds when what is left of the budget also covers
# one round of every C after it and direct; else one round; else it is skipped. Each is stopped at twice its
# estimate (plus 20 s) or at the budget's end.
: >"$OUT/cores.txt"
set -- $CORES
while [ $# -gt 0 ]; do
    cores=$1
    shift
    budget=$(($(left) - RESERVE_S))
    after=$(($# * $(estimate 1) + DIRECT_S))
    rounds=$ROUNDS
    [ "$budget" -lt $(($(estimate "$rounds") + after)) ] && rounds=1
    if [ "$budget" -lt "$(estimate 1)" ]; then
        note "4. cores C=$cores: SKIPPED, ${budget}s left of the budget, $(estimate 1)s needed"
        continue
    fi
    limit=$((2 * $(estimate "$rounds") + 20))
    [ "$limit" -gt "$budget" ] && limit=$budget
    stamp "4. cores C=$cores: $rounds round(s), about $(estimate "$rounds")s (${budget}s left)"
    step_start=$SECONDS
    bench "$cores" "$rounds" "$TARGETS" "$WORK/c$cores" "$limit"
    rc=$?
    note "4. cores C=$cores: rc=$rc in $((SECONDS - step_start))s ($rounds round(s), estimated $(estimate "$rounds")s)"
done
if [ "$DIRECT" = 1 ]; then
    widest=$(for c in $CORES; do echo "$c"; done | sort -n | tail -1)
    budget=$(($(left) - RESERVE_S))
    if [ "$budget" -ge "$DIRECT_S" ]; then
        limit=$((2 * DIRECT_S + 20))
        [ "$limit" -gt "$budget" ] && limit=$budget
        stamp "4. direct: the backends alone, on the CPUs the C=$widest run left them"
        step_start=$SECONDS
        bench "$widest" 1 direct "$WORK/direct" "$limit"
        note "4. direct (the backends' ceiling beside C=$widest): rc=$? in $((SECONDS - step_start))s"
    else
        note "4. direct: SKIPPED, ${budget}s left of the budget, ${DIRECT_S}s needed"
    fi
fi

# -- the summary of the cores --------------------------------------------------------------------------------
"$PYTHON" - "$WORK" >"$OUT/cores-summary.txt" 2>&1 <<'EOF'
import csv
import statistics
import sys
from pathlib import Path

from dpserve.text_table import format_table

work = Path(sys.argv[1])
rows = []
for path in sorted(work.glob("*/overhead.csv")):
    cores = path.parent.name
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            rows.append({**row, "C": cores})


def median(values):
    values = [float(v) for v in values if v not in ("", None)]
    return statistics.median(values) if values else None


def fmt(value, digits=0):
    return "" if value is None else f"{value:.{digits}f}"


def label(row):
    return f"{row['target']}({row['policy']})" if row["policy"] else row["target"]


def c_key(cores):
    return (cores == "direct", int(cores[1:]) if cores[1:].isdigit() else 0)


groups = {}
for row in rows:
    if row["connections"] == "1":
        continue
    groups.setdefault((row["C"], row["mode"], label(row)), []).append(row)
base = {}
table = []
for (cores, mode, name), runs in sorted(groups.items(), key=lambda item: (c_key(item[0][0]), item[0][1], item[0][2])):
    rps = median(r["req_s"] for r in runs)
    cpu = median(r["router_cpu"] for r in runs)
    if cores == "c1":
        base[(mode, name)] = rps
    scale = rps / base[(mode, name)] if base.get((mode, name)) and rps else None
    table.append([
        cores, mode, name, runs[0]["connections"], len(runs), fmt(rps), fmt(cpu, 2),
        fmt(rps / cpu if rps and cpu else None), fmt(scale, 2) if scale else "",
        fmt(median(r["p50_ms"] for r in runs), 2), fmt(median(r["p99_ms"] for r in runs), 2),
        sum(int(r["errors"]) for r in runs), fmt(median(r["loadgen_cpu"] for r in runs), 2),
        fmt(median(r["backends_cpu"] for r in runs), 2), fmt(median(r["load1"] for r in runs), 1),
    ])
header = ["C", "mode", "target", "conns", "runs", "req_s", "router_cpu", "req_s/cpu", "x_C1", "p50_ms", "p99_ms",
          "errors", "loadgen_cpu", "backends_cpu", "load1"]
print("Throughput at the many-connection count (medians over rounds; router_cpu in cores; x_C1: over the same")
print("target's req/s at C=1; direct: the backends alone on the CPUs left beside the widest C)")
print(format_table(header, table, align="right"))

print("\ndpserve / vllm-router req/s, per round (same C, mode and round), median:")
ratios = []
for cores in sorted({r["C"] for r in rows if r["C"] != "direct"}, key=c_key):
    for mode in ("json", "sse"):
        mine = [r for r in rows if r["C"] == cores and r["mode"] == mode and r["connections"] != "1"]
        for policy in sorted({r["policy"] for r in mine if r["target"] == "dpserve"}):
            per_round = []
            for rnd in sorted({r["round"] for r in mine}):
                ours = [float(r["req_s"]) for r in mine if r["round"] == rnd and r["target"] == "dpserve"
                        and r["policy"] == policy]
                theirs = [float(r["req_s"]) for r in mine if r["round"] == rnd and r["target"] == "vllm-router"]
                if ours and theirs and theirs[0] > 0:
                    per_round.append(ours[0] / theirs[0])
            if per_round:
                ratios.append([cores, mode, f"dpserve({policy})", f"{statistics.median(per_round):.2f}",
                               " ".join(f"{x:.2f}" for x in per_round)])
print(format_table(["C", "mode", "ours", "median", "rounds"], ratios, align="right"))

print("\np50 at 1 connection over backend 0 alone, median; over_direct: minus direct's (its own run), ms:")
added = {}
for row in rows:
    if row["connections"] == "1":
        added.setdefault((row["C"], row["mode"], label(row)), []).append(row)
direct = {m: median(r["p50_ms"] for r in rs) for (c, m, n), rs in added.items() if n == "direct"}
table = []
for (c, m, n), rs in sorted(added.items(), key=lambda item: (c_key(item[0][0]), item[0][1], item[0][2])):
    p50 = median(r["p50_ms"] for r in rs)
    over = p50 - direct[m] if n != "direct" and direct.get(m) is not None else None
    table.append([c, m, n, fmt(p50, 3), fmt(over, 3), fmt(median(r["router_cpu"] for r in rs), 2)])
print(format_table(["C", "mode", "target", "p50_ms", "over_direct_ms", "router_cpu"], table, align="right"))
EOF
note "5. summary: rc=$? ($(grep -c . "$OUT/cores-summary.txt") lines); cores.txt warnings: $(grep -c "warning" "$OUT/cores.txt")"
(cd "$WORK" && tar -czf "$OUT/cores.tar.gz" --exclude=pip.txt . 2>/dev/null)
echo
cat "$OUT/cores-summary.txt"
echo
grep -h "warning\|failed\|skipped\|Traceback\|Error" "$OUT/cores.txt" | sort | uniq -c | head -20
echo
cat "$OUT/summary.txt"
stamp "done in $((SECONDS - START))s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit 0
