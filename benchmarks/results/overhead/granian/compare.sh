#!/bin/bash
# Run from the checkout's root, with granian installed somewhere (GRANIAN_LIB, default /tmp/grlib:
#   .venv/bin/pip install --target /tmp/grlib granian). Output of the 2026-11-27 run: output.txt.
# uvicorn (dpserve router) vs granian (the same app, ASGI), ABBA, over two fast backends; router on CPU 1.
GRANIAN_LIB=${GRANIAN_LIB:-/tmp/grlib}
pkill -f "fast_backend --port 2480" || true
taskset -c 0 .venv/bin/python -m benchmarks.fast_backend --port 24801 & B1=$!
taskset -c 0 .venv/bin/python -m benchmarks.fast_backend --port 24802 & B2=$!
sleep 1
REPL=http://127.0.0.1:24801,http://127.0.0.1:24802
run() { # $1 label; starts server, loads it, prints req/s for json and sse
  if [ "$1" = uvicorn ]; then
    taskset -c 1 .venv/bin/python -m dpserve router --replica http://127.0.0.1:24801 --replica http://127.0.0.1:24802 --policy round_robin --port 24800 --gpu-interval 0 --log-level warning & S=$!
  else
    DPSERVE_REPLICAS=$REPL PYTHONPATH=$GRANIAN_LIB:benchmarks/results/overhead/granian:$PWD taskset -c 1 .venv/bin/python -m granian --interface asgi --port 24800 --workers 1 --loop uvloop --log-level warning --no-ws router_app:app & S=$!
  fi
  for i in $(seq 100); do curl -sf localhost:24800/ready >/dev/null && break; sleep 0.2; done
  for m in json sse; do
    taskset -c 0 wrk -t1 -c32 -d1 -s benchmarks/results/overhead/granian/$m.lua http://127.0.0.1:24800/v1/completions > /dev/null
    r=$(taskset -c 0 wrk -t1 -c32 -d5 -s benchmarks/results/overhead/granian/$m.lua http://127.0.0.1:24800/v1/completions | awk '/Requests\/sec/ {print $2}')
    echo "$1 $m $r"
  done
  kill $S; wait $S 2>/dev/null
}
for round in 1 2; do
  run uvicorn; run granian; run granian; run uvicorn
done
kill $B1 $B2
