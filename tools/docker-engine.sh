#!/usr/bin/env bash
# A Docker engine with Compose v2 and buildx, answering here: Debian's docker.io where no engine is installed,
# Compose and buildx from Debian's next release (trixie) where the installed CLI has neither (bookworm packages
# only Compose v1, which reads neither `!reset` nor `start_interval`; each checked against trixie's signed index
# before it is installed), and dockerd started where none runs.
# Exits non-zero, saying why, where no engine can run (then the compose tests skip and say so).
set -euo pipefail
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
LOG=${DOCKERD_LOG:-/tmp/dpserve-dockerd.log}
HERE=$(dirname "$(realpath "$0")")

apt_install() {
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# A package of trixie's, by name (so a point release that renames its file is no matter), installed only once
# tools/debian-deb.sh has checked it against trixie's signed index.
trixie_package() {
    local dir deb
    # What checks it: gpgv and the archive's keys (both on any Debian; Ubuntu has the keyring to install).
    command -v gpgv >/dev/null && [ -r /usr/share/keyrings/debian-archive-keyring.gpg ] ||
        apt_install gpgv debian-archive-keyring
    dir=$(mktemp -d)
    deb=$(DEBIAN_MIRROR=$MIRROR DEBIAN_SUITE=trixie "$HERE/debian-deb.sh" "$1" "$dir") || { rm -rf "$dir"; return 1; }
    $SUDO dpkg -i "$deb" >/dev/null
    rm -rf "$dir"
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
