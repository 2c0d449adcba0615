#!/usr/bin/env bash
# `make floors`: every lower bound pyproject.toml declares, tested together. uv installs dpserve with its test and
# bench extras at `--resolution lowest-direct` (each requirement dpserve names at the oldest release its bound
# allows; what those bring, at what they ask) into .venv/floors, then runs the unit suite and the router's
# integration tests that need no engine (the engine extra pins its own). A bound the code has outgrown fails here,
# not on a user's machine that happens to hold an old release.
#   tools/floors.sh [PYTEST ARGS...]   (default: the suites below)
set -euo pipefail
PYTHON=${PYTHON:-python3}
UV_VERSION=0.13.9
HERE=.venv/floors

if [ ! -x "$HERE/tool/bin/uv" ]; then
    "$PYTHON" -m venv "$HERE/tool"
    "$HERE/tool/bin/python" -m pip install -q "uv==$UV_VERSION"
fi
uv=$HERE/tool/bin/uv
rm -rf "$HERE/env"
"$uv" venv -q -p "$PYTHON" "$HERE/env"
"$uv" pip install -q -p "$HERE/env/bin/python" --resolution lowest-direct ".[test,bench]"
# pip too, today's: a unit test builds the package's wheel with it, as the router image does.
"$uv" pip install -q -p "$HERE/env/bin/python" pip

echo "At their floors (dpserve's own requirements):"
"$HERE/env/bin/python" - <<'LIST'
import importlib.metadata as md
from packaging.requirements import Requirement
for line in md.requires("dpserve") or []:
    requirement = Requirement(line)
    if requirement.marker is None:
        print(f"  {requirement.name} {md.version(requirement.name)} ({requirement.specifier})")
LIST

if [ $# -eq 0 ]; then
    set -- tests/unit -m "not engine" \
        tests/integration/test_router_wire.py tests/integration/test_router_http.py tests/integration/test_security.py \
        tests/integration/test_graceful_shutdown.py tests/integration/test_tls.py tests/integration/test_peer_tls.py \
        tests/integration/test_secret_rotation.py tests/integration/test_fuzz.py tests/integration/test_sim_fleet.py
fi
# The source as it is (interpreted: the compiled build belongs to .venv's Python and libraries).
DPSERVE_PURE_PYTHON=1 DPSERVE_BUILD=pure "$HERE/env/bin/python" -m pytest -p no:cacheprovider -q "$@"
