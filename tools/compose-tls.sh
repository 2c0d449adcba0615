#!/usr/bin/env bash
# The TLS files of `dpserve compose --tls`, made with openssl into .secrets/tls/ (git-ignored):
#   tools/compose-tls.sh SERVICE...   (the names compose.tls.yaml's header lists; make compose-up TLS=1 runs it)
# ca.crt and ca.key: the stack's own CA, made once (ca.key is never mounted in a container). router.crt and
# router.key for the services named router*, vllm.crt and vllm.key for the others, each certificate naming its
# services, localhost and 127.0.0.1 (the healthchecks, and clients on this host through the published port).
# A certificate is kept while it names the same services and has 30 days left; else (or with RENEW=1) it is
# made again, in place: the files are bind mounts of these inodes, and the routers (--ssl-*) and vLLM
# (--enable-ssl-refresh) read them again when they change. Modes as tools/compose-secrets.sh says: the folder
# 700, the mounted files 644 (the containers read them as nobody).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: $0 SERVICE... (the services compose.tls.yaml's header lists)" >&2; exit 2; }
DIR=.secrets/tls
DAYS=90
EC=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
(umask 077 && mkdir -p "$DIR")
chmod 700 .secrets "$DIR"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# in_place SOURCE DEST: DEST's inode keeps SOURCE's bytes, readable in the containers.
in_place() {
    [ -f "$2" ] || (umask 077 && : >"$2")
    cat "$1" >"$2"
    chmod 644 "$2"
}

if [ ! -s "$DIR/ca.key" ] || [ ! -s "$DIR/ca.crt" ]; then
    (umask 077 && openssl req -x509 "${EC[@]}" -keyout "$DIR/ca.key" -out "$WORK/ca.crt" -days 3650 \
        -subj "/CN=dpserve compose CA" -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null)
    in_place "$WORK/ca.crt" "$DIR/ca.crt"
fi
chmod 600 "$DIR/ca.key"

issue() {  # issue PART NAME...: PART.crt and PART.key for these names
    local part=$1 sans="" name
    shift
    for name in "$@"; do sans+="DNS:$name,"; done
    sans+="DNS:localhost,IP:127.0.0.1"
    if [ -z "${RENEW:-}" ] && [ -s "$DIR/$part.crt" ] && [ -s "$DIR/$part.key" ] \
        && [ "$(cat "$DIR/$part.names" 2>/dev/null)" = "$sans" ] \
        && openssl x509 -in "$DIR/$part.crt" -noout -checkend $((30 * 86400)) >/dev/null \
        && openssl verify -CAfile "$DIR/ca.crt" "$DIR/$part.crt" >/dev/null 2>&1; then
        return
    fi
    (umask 077 && openssl req -new "${EC[@]}" -keyout "$WORK/$part.key" -out "$WORK/$part.csr" -subj "/CN=$1" 2>/dev/null)
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=critical,digitalSignature\nbasicConstraints=CA:FALSE\nauthorityKeyIdentifier=keyid\n' \
        "$sans" >"$WORK/$part.ext"
    openssl x509 -req -in "$WORK/$part.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" \
        -set_serial "0x$(openssl rand -hex 16)" -days "$DAYS" -extfile "$WORK/$part.ext" -out "$WORK/$part.crt" 2>/dev/null
    # The key first, then its certificate: a reader between the two finds a pair that does not match, which
    # keeps the one in force until the next look.
    in_place "$WORK/$part.key" "$DIR/$part.key"
    in_place "$WORK/$part.crt" "$DIR/$part.crt"
    printf '%s' "$sans" >"$DIR/$part.names"
    echo "compose-tls: $DIR/$part.crt for $sans" >&2
}

routers=()
replicas=()
for name in "$@"; do
    case $name in
    router*) routers+=("$name") ;;
    *) replicas+=("$name") ;;
    esac
done
[ ${#routers[@]} -eq 0 ] || issue router "${routers[@]}"
[ ${#replicas[@]} -eq 0 ] || issue vllm "${replicas[@]}"
