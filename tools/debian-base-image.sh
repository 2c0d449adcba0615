#!/usr/bin/env bash
# A stand-in for python:3.11-slim, made from Debian's packages, for hosts that cannot reach Docker Hub:
#   tools/debian-base-image.sh [TAG]   (default dpserve-base:bookworm; needs root, debootstrap and a Docker engine)
# then build with --build-arg BASE_IMAGE=TAG (`make compose-up` does both on its own when Docker Hub is out of reach).
# Bookworm's python3 is 3.11, the release the upstream image pins; python3-dev for its headers, which the
# upstream image has too and torch's compiler (vLLM on the CPU) includes. The host's CA certificates go in too: where
# egress passes through a TLS-inspecting proxy, pip inside the build needs the same trust as pip on the host.
set -euo pipefail
TAG=${1:-dpserve-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "$TAG exists"
    exit 0
fi
ROOTFS=$(mktemp -d /tmp/dpserve-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

debootstrap --variant=minbase --include=python3,python3-dev,python3-pip,python3-venv,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR" >/dev/null
# The upstream image's pip installs into the system Python; so does this one (no PEP 668 marker).
rm -f "$ROOTFS"/usr/lib/python3.*/EXTERNALLY-MANAGED
ln -sf python3 "$ROOTFS/usr/bin/python"
ln -sf pip3 "$ROOTFS/usr/bin/pip"
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
    chroot "$ROOTFS" update-ca-certificates >/dev/null
fi
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin

tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$TAG" >/dev/null
echo "$TAG built from Debian bookworm"
