#!/usr/bin/env bash
# A private Docker engine for kvmesh's containers on a machine with no registry access and no
# container networking: host networking only, no bridge, no iptables, no image pulls.
#
#   scripts/local-docker.sh up      install what is missing, start the engine, build the base and
#                                   kvmesh images (the container quick start; idempotent)
#   scripts/local-docker.sh env     print `export DOCKER_HOST=...` for this engine (eval it)
#   scripts/local-docker.sh down    stop the engine this script started (by its PID) and clean up
#   scripts/local-docker.sh install | start | base | image | status   the steps of `up`, one by one
#
# Every container must then use host networking (docker-compose.host.yml does); all traffic stays on
# 127.0.0.1. Where a normal Docker engine with registry access runs, none of this is needed:
# `docker compose up --build` uses the official Python image.
#
# Environment:
#   KVMESH_DOCKER_DIR   the engine's state: data root, exec root, socket, PID and log
#                       (default /tmp/kvmesh-docker)
#   KVMESH_BASE_IMAGE   tag of the locally built base image (default kvmesh-base:bookworm)
#   KVMESH_IMAGE        tag of the kvmesh image (default kvmesh:latest)
#   DEBIAN_MIRROR       where debootstrap fetches Debian (default: the first Debian archive this
#                       machine's own apt configuration names; the script names no host itself)
set -euo pipefail

# The Debian archive this machine's apt already uses: the first `URIs:` line of a deb822 source, or
# the first `deb` line of a one-line source, that ends in /debian (not the security archive).
apt_mirror() {
    local file
    for file in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$file" ] || continue
        awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i ~ /\/debian\/?$/) { print $i; exit } }
             /^deb / { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\/.*\/debian\/?$/) { print $i; exit } }' "$file"
    done | head -n 1
}

STATE_DIR="${KVMESH_DOCKER_DIR:-/tmp/kvmesh-docker}"
BASE_IMAGE="${KVMESH_BASE_IMAGE:-kvmesh-base:bookworm}"
IMAGE="${KVMESH_IMAGE:-kvmesh:latest}"
MIRROR="${DEBIAN_MIRROR:-$(apt_mirror)}"
SOCKET="$STATE_DIR/docker.sock"
PID_FILE="$STATE_DIR/dockerd.pid"
LOG_FILE="$STATE_DIR/dockerd.log"
EXEC_ROOT="$STATE_DIR/exec"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
# Debian's docker.io client; a newer client elsewhere on PATH works too (it negotiates the API).
export DOCKER_HOST="unix://$SOCKET"
# The classic builder: BuildKit needs the buildx plugin, which Debian's docker.io lacks.
export DOCKER_BUILDKIT=0

log() { echo "local-docker: $*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() {
    [ "$(id -u)" -eq 0 ] || die "$1 needs root (dockerd and debootstrap do); run it with sudo"
}

engine_pid() {
    [ -f "$PID_FILE" ] || return 1
    local pid
    pid="$(cat "$PID_FILE")"
    kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

engine_answers() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

cmd_install() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    # docker-init (tini) forwards signals to a container's PID 1: compose's `init: true` needs it
    [ -x /usr/bin/docker-init ] || [ -x /usr/libexec/docker/docker-init ] || missing+=(tini)
    if ! command -v docker-compose >/dev/null && ! docker compose version >/dev/null 2>&1; then
        missing+=(docker-compose)
    fi
    [ "${#missing[@]}" -eq 0 ] && return 0
    need_root "installing ${missing[*]}"
    command -v apt-get >/dev/null || die "apt-get not found: install ${missing[*]} by hand"
    log "installing ${missing[*]} from Debian's packages"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

cmd_start() {
    if engine_pid >/dev/null && engine_answers; then
        log "engine already running (PID $(engine_pid), $DOCKER_HOST)"
        return 0
    fi
    need_root "starting dockerd"
    command -v dockerd >/dev/null || die "dockerd not found: run '$0 install' first"
    mkdir -p "$STATE_DIR/data" "$EXEC_ROOT"
    # No bridge and no NAT rules: nothing gets a private address and the host firewall is untouched.
    # Containers reach each other and the host on 127.0.0.1 through host networking.
    dockerd \
        --host "unix://$SOCKET" \
        --data-root "$STATE_DIR/data" \
        --exec-root "$EXEC_ROOT" \
        --pidfile "$STATE_DIR/dockerd.own.pid" \
        --bridge=none --iptables=false --ip6tables=false \
        --ip-forward=false --ip-masq=false --userland-proxy=false \
        >"$LOG_FILE" 2>&1 &
    echo $! >"$PID_FILE"
    local deadline=$((SECONDS + 60))
    until engine_answers; do
        if ! kill -0 "$(cat "$PID_FILE")" 2>/dev/null; then
            tail -n 20 "$LOG_FILE" >&2
            die "dockerd exited during start-up (log: $LOG_FILE)"
        fi
        [ "$SECONDS" -lt "$deadline" ] || die "dockerd did not answer within 60 s (log: $LOG_FILE)"
        sleep 0.5
    done
    log "engine up: PID $(cat "$PID_FILE"), $DOCKER_HOST"
}

cmd_base() {
    engine_answers || die "no engine answers at $DOCKER_HOST: run '$0 start' first"
    if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        log "base image $BASE_IMAGE already built"
        return 0
    fi
    need_root "debootstrap"
    command -v debootstrap >/dev/null || die "debootstrap not found: run '$0 install' first"
    [ -n "$MIRROR" ] || die "this machine's apt configuration names no Debian archive: set DEBIAN_MIRROR"
    local root="$STATE_DIR/rootfs"
    rm -rf "$root"
    log "building $BASE_IMAGE with debootstrap (Debian bookworm, minbase, Python 3.11)"
    local started=$SECONDS
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$root" "$MIRROR" >"$STATE_DIR/debootstrap.log" 2>&1 \
        || { tail -n 20 "$STATE_DIR/debootstrap.log" >&2; die "debootstrap failed"; }
    # Nothing in the image needs apt's lists or caches.
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
    # The image trusts what the host trusts: where the host reaches the package index through a
    # TLS-inspecting proxy, its CA is in this bundle, and pip in the build needs it (pip reads PIP_CERT,
    # not the system store).
    local bundle=/etc/ssl/certs/ca-certificates.crt
    [ -f "$bundle" ] && cp "$bundle" "$root$bundle"
    tar -C "$root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change "ENV PIP_CERT=$bundle SSL_CERT_FILE=$bundle REQUESTS_CA_BUNDLE=$bundle" \
        --change 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$root"
    log "base image $BASE_IMAGE built in $((SECONDS - started)) s"
}

cmd_image() {
    engine_answers || die "no engine answers at $DOCKER_HOST: run '$0 start' first"
    docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || die "no base image $BASE_IMAGE: run '$0 base' first"
    log "building $IMAGE from $REPO on $BASE_IMAGE"
    local started=$SECONDS
    # Host network: the build's pip reaches the package index the way the host does.
    docker build --quiet --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE" "$REPO" >/dev/null
    log "image $IMAGE built in $((SECONDS - started)) s"
}

cmd_down() {
    local pid
    if ! pid="$(engine_pid)"; then
        log "no engine of this script's is running"
    else
        # Containers first, so none is left holding the exec root.
        local running
        running="$(docker ps -q 2>/dev/null || true)"
        [ -z "$running" ] || docker kill $running >/dev/null 2>&1 || true
        kill "$pid"
        local deadline=$((SECONDS + 30))
        while kill -0 "$pid" 2>/dev/null; do
            [ "$SECONDS" -lt "$deadline" ] || { log "dockerd ignored SIGTERM for 30 s; killing it"; kill -9 "$pid"; }
            sleep 0.2
        done
        log "engine stopped (PID $pid)"
    fi
    rm -f "$PID_FILE"
    # dockerd leaves its default network namespace mounted under the exec root.
    if mountpoint -q "$EXEC_ROOT/netns/default" 2>/dev/null; then
        umount "$EXEC_ROOT/netns/default"
    fi
}

cmd_status() {
    if pid="$(engine_pid)" && engine_answers; then
        echo "running: PID $pid, $DOCKER_HOST, server $(docker version --format '{{.Server.Version}}')"
        docker image ls --format '  {{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "kvmesh" || true
    else
        echo "not running ($STATE_DIR)"
        return 1
    fi
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start ;;
    base) cmd_base ;;
    image) cmd_image ;;
    up) cmd_install; cmd_start; cmd_base; cmd_image; echo "export DOCKER_HOST=$DOCKER_HOST" ;;
    env) echo "export DOCKER_HOST=$DOCKER_HOST" ;;
    down | stop) cmd_down ;;
    status) cmd_status ;;
    -h | --help | help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' ;;
    *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
