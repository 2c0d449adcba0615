#!/usr/bin/env bash
# The images' build arguments for this host, as shell assignments for `make compose-up VARIANT=...`:
#   tools/compose-build-args.sh [VARIANT]
#   BASE_IMAGE  python:3.11-slim where Docker Hub answers, else a base made from Debian's packages
#               (tools/debian-base-image.sh);
#   TORCH_INDEX `none` where this host's pip keeps torch's CPU wheel on disk (copied into replicas/wheels/),
#               else PyTorch's CPU index (the Dockerfile's default).
set -euo pipefail
cd "$(dirname "$0")/.."
UPSTREAM=python:3.11-slim
LOCAL=dpserve-base:bookworm

if docker image inspect "$UPSTREAM" >/dev/null 2>&1 || docker pull -q "$UPSTREAM" >/dev/null 2>&1; then
    echo "BASE_IMAGE=$UPSTREAM"
else
    echo "Docker Hub is out of reach: building the base image from Debian's packages" >&2
    tools/debian-base-image.sh "$LOCAL" >&2
    echo "BASE_IMAGE=$LOCAL"
fi

# Only the CPU replica's image installs torch (and the wheel would swell every other build's context).
[ "${1:-cpu}" = cpu ] || exit 0
# Where pip looks for local wheels: PIP_FIND_LINKS and pip's own configuration.
links=$( (echo "${PIP_FIND_LINKS:-}"; python3 -m pip config list 2>/dev/null | sed -n "s/^.*find-links='\(.*\)'$/\1/p") | tr ' ' '\n')
found=""
for dir in $links; do
    dir=${dir#file://}
    for wheel in "$dir"/torch-*+cpu-*.whl; do
        [ -f "$wheel" ] || continue
        cp -u "$wheel" replicas/wheels/
        found=1
    done
done
if [ -n "$found" ]; then
    echo "TORCH_INDEX=none"
fi
