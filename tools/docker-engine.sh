#!/usr/bin/env bash
# A Docker engine with Compose v2 and buildx, answering here: Debian's docker.io where no engine is installed,
# Compose and buildx from Debian's next release (trixie) where the installed CLI has neither (bookworm packages
# only Compose v1, which reads neither `!reset` nor `start_interval`), and dockerd started where none runs.
# Exits non-zero, saying why, where no engine can run (then the compose tests skip and say so).
set -euo pipefail
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
LOG=${DOCKERD_LOG:-/tmp/dpserve-dockerd.log}

apt_install() {
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# A package of trixie's, by name: its file found in trixie's index, so a point release that renames it is no matter.
trixie_package() {
    local arch index file
    arch=$(dpkg --print-architecture)
    index=$(mktemp)
    curl -fsS "$MIRROR/dists/trixie/main/binary-$arch/Packages.xz" | xz -dc >"$index"
    file=$(awk -v pkg="$1" '$1 == "Package:" { hit = ($2 == pkg) } hit && $1 == "Filename:" { print $2; exit }' "$index")
    rm -f "$index"
    [ -n "$file" ] || { echo "no $1 in trixie's index" >&2; return 1; }
    curl -fsS "$MIRROR/$file" -o "/tmp/$(basename "$file")"
    $SUDO dpkg -i "/tmp/$(basename "$file")" >/dev/null
}

command -v dockerd >/dev/null || apt_install docker.io iptables xz-utils curl debootstrap
command -v debootstrap >/dev/null || apt_install debootstrap
docker compose version >/dev/null 2>&1 || trixie_package docker-compose
docker buildx version >/dev/null 2>&1 || trixie_package docker-buildx

if ! docker info >/dev/null 2>&1; then
    nohup $SUDO dockerd >"$LOG" 2>&1 &
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 0.5
    done
fi
docker info >/dev/null 2>&1 || { echo "dockerd did not start: see $LOG" >&2; exit 1; }
echo "Docker engine $(docker info -f '{{.ServerVersion}}'), $(docker compose version --short 2>/dev/null || true)"
