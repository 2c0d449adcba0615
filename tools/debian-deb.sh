#!/usr/bin/env bash
# One package of a Debian suite's main component, downloaded into DIR and checked as apt checks it, its path printed:
#   tools/debian-deb.sh PACKAGE DIR
# The suite's InRelease verified with gpgv against the Debian archive keyring (alone: an empty GNUPGHOME), its suite
# named as asked and not past its Valid-Until; Packages.xz against the SHA256 that verified text gives it; the .deb
# against the SHA256 its entry in that index gives. Any mismatch: a message saying which, non-zero, no .deb left.
# The mirror may be plain HTTP (or file://): what it serves counts only once it matches the signature.
# Environment: DEBIAN_MIRROR, DEBIAN_SUITE (trixie), DEBIAN_KEYRING (the archive keyring), DEBIAN_ARCH (dpkg's).
set -euo pipefail
PACKAGE=${1:?usage: debian-deb.sh PACKAGE DIR}
DIR=${2:?usage: debian-deb.sh PACKAGE DIR}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=${DEBIAN_SUITE:-trixie}
KEYRING=${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
ARCH=${DEBIAN_ARCH:-$(dpkg --print-architecture)}
INDEX=main/binary-$ARCH/Packages.xz

fail() {
    echo "debian-deb.sh: $PACKAGE from $MIRROR ($SUITE): $*" >&2
    exit 1
}

for tool in gpgv curl xz sha256sum; do
    command -v "$tool" >/dev/null || fail "$tool is not installed"
done
[ -r "$KEYRING" ] || fail "no keyring at $KEYRING (apt-get install debian-archive-keyring)"
KEYRING=$(realpath "$KEYRING")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

fetch() {
    curl -fsSL --retry 3 "$MIRROR/$1" -o "$2" || fail "cannot download $MIRROR/$1"
}

# The file's SHA256 must be the one the signed text gave.
check_sum() {
    local want=$1 file=$2 what=$3 got
    got=$(sha256sum "$file" | cut -d' ' -f1)
    [ "$got" = "$want" ] || fail "$what has SHA256 $got, the signed index says $want: refused"
}

# The suite's Release text, kept only if a key of the keyring signed it: at least one good signature, no bad one.
fetch "dists/$SUITE/InRelease" "$WORK/InRelease"
mkdir -m 700 "$WORK/gnupg"
GNUPGHOME="$WORK/gnupg" gpgv --status-fd 3 --keyring "$KEYRING" --output "$WORK/Release" "$WORK/InRelease" \
    3>"$WORK/status" 2>"$WORK/gpgv.log" || true
if ! grep -q '^\[GNUPG:\] GOODSIG ' "$WORK/status" || grep -q '^\[GNUPG:\] BADSIG ' "$WORK/status"; then
    fail "dists/$SUITE/InRelease is not signed by a key of $KEYRING: $(grep -v '^gpgv: *using' "$WORK/gpgv.log" | tr '\n' ' ')"
fi
field() { awk -v name="$1:" '$1 == name { sub(/^[^:]*: */, ""); print; exit }' "$WORK/Release"; }
[ "$(field Codename)" = "$SUITE" ] || [ "$(field Suite)" = "$SUITE" ] ||
    fail "the signed InRelease is $(field Suite)/$(field Codename)'s, not $SUITE's"
valid_until=$(field Valid-Until)
if [ -n "$valid_until" ] && [ "$(date -d "$valid_until" +%s)" -lt "$(date +%s)" ]; then
    fail "the signed InRelease expired at $valid_until"
fi

index_sum=$(awk -v path="$INDEX" '/^[^ ]/ { in_sha256 = ($1 == "SHA256:") } in_sha256 && $3 == path { print $1; exit }' \
    "$WORK/Release")
[ -n "$index_sum" ] || fail "the signed InRelease lists no SHA256 for $INDEX"
fetch "dists/$SUITE/$INDEX" "$WORK/Packages.xz"
check_sum "$index_sum" "$WORK/Packages.xz" "dists/$SUITE/$INDEX"

# The package's entry: its file and that file's SHA256, both from the one stanza.
read -r file deb_sum < <(xz -dc "$WORK/Packages.xz" | awk -v pkg="$PACKAGE" '
    /^$/ { if (hit) exit }
    $1 == "Package:" { hit = ($2 == pkg) }
    hit && $1 == "Filename:" { file = $2 }
    hit && $1 == "SHA256:" { sum = $2 }
    END { if (file != "" && sum != "") print file, sum }') || true
[ -n "${file:-}" ] || fail "no $PACKAGE with a SHA256 in $SUITE's $INDEX"
[[ $file =~ ^pool/[A-Za-z0-9.+~_/-]+\.deb$ && $file != *..* ]] || fail "its index names an odd file: $file"

mkdir -p "$DIR"
fetch "$file" "$WORK/package.deb"
check_sum "$deb_sum" "$WORK/package.deb" "$file"
mv "$WORK/package.deb" "$DIR/$(basename "$file")"
echo "$DIR/$(basename "$file")"
