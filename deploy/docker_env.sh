#!/usr/bin/env bash
# The Docker side of `make compose-test` (deploy/compose_test.py calls it), usable alone:
#   deploy/docker_env.sh up     engine, `docker compose` + buildx plugins, a running dockerd, the base images
#   deploy/docker_env.sh down   stop the dockerd that `up` started and remove what it leaves behind
#                               (its iptables chains and rules, docker0, compose bridges); nothing if `up` started none
# Installs only what is missing, with apt (root). Nothing is removed on a machine whose dockerd was already running.
#
# Base images: each of debian:bookworm-slim, python:3.11-slim, redis:7-bookworm is used as found, else pulled, else
# (no registry reachable) built locally under the same name: Debian bookworm by debootstrap + `docker import` (with
# this host's CA certificates, which HTTPS interception here needs), and python / redis stand-ins on it from Debian's
# packages (deploy/images/*/Dockerfile).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE="${SPECDEC_DOCKER_STATE:-/run/specdec-docker}"     # what `up` started, for `down`
DOCKERD_LOG="${SPECDEC_DOCKERD_LOG:-/var/log/specdec-dockerd.log}"
PLUGIN_SUITE="${SPECDEC_PLUGIN_SUITE:-trixie}"            # a Debian suite with docker-compose v2 and docker-buildx
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
MIRROR="${SPECDEC_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

say() { printf 'docker-env: %s\n' "$*"; }
die() { say "error: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "$1 needs root (apt, dockerd)"; }
apt_install() {
    need_root "installing $*"
    say "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null; }
}

install_engine() {
    if command -v dockerd >/dev/null || docker info >/dev/null 2>&1; then return; fi
    apt_install docker.io
}

# Debian bookworm has only docker-compose v1 and no buildx; the packages of a newer suite hold static Go binaries
# (libc only), so they are downloaded with a throwaway apt configuration (the system's sources are not touched) and
# the binaries copied to the CLI plugin directory.
install_plugins() {
    local want=()
    docker compose version >/dev/null 2>&1 || want+=(docker-compose)
    docker buildx version >/dev/null 2>&1 || want+=(docker-buildx)
    [ ${#want[@]} -eq 0 ] && return
    need_root "installing the docker CLI plugins"
    local tmp; tmp="$(mktemp -d)"
    mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/x"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR $PLUGIN_SUITE main" > "$tmp/sources.list"
    local o=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o APT::Sandbox::User=root)
    say "downloading ${want[*]} from Debian $PLUGIN_SUITE (CLI plugins)"
    apt-get "${o[@]}" update -q >/dev/null
    (cd "$tmp" && apt-get "${o[@]}" download "${want[@]}" >/dev/null)
    for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/x"; done
    mkdir -p "$PLUGIN_DIR"
    install -m 0755 "$tmp"/x/usr/libexec/docker/cli-plugins/docker-* "$PLUGIN_DIR"/
    rm -rf "$tmp"
    docker compose version >/dev/null || die "docker compose plugin does not run"
    say "$(docker compose version), $(docker buildx version | cut -d' ' -f1,2) in $PLUGIN_DIR"
}

start_dockerd() {
    if docker info >/dev/null 2>&1; then say "dockerd already running (left as it is)"; return; fi
    need_root "starting dockerd"
    mkdir -p "$STATE"
    iptables -S FORWARD 2>/dev/null | awk '$1 == "-P" {print $3}' > "$STATE/forward_policy" || true
    ip link show docker0 >/dev/null 2>&1 && touch "$STATE/had_docker0" || rm -f "$STATE/had_docker0"
    say "starting dockerd (log $DOCKERD_LOG)"
    setsid dockerd >"$DOCKERD_LOG" 2>&1 < /dev/null &
    echo $! > "$STATE/dockerd.pid"
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && { say "dockerd $(docker version -f '{{.Server.Version}}') up"; return; }
        kill -0 "$(cat "$STATE/dockerd.pid")" 2>/dev/null || { tail -20 "$DOCKERD_LOG" >&2; die "dockerd exited"; }
        sleep 1
    done
    die "dockerd did not answer within 60 s (log: $DOCKERD_LOG)"
}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

pull_or() {   # pull_or IMAGE BUILDER: use IMAGE as found, else pull it, else run BUILDER
    local image=$1 builder=$2
    if have_image "$image"; then say "$image: present"; return; fi
    if timeout 120 docker pull -q "$image" >/dev/null 2>&1; then say "$image: pulled"; return; fi
    say "$image: cannot be pulled; building a local stand-in"
    "$builder" "$image"
}

build_debian() {   # debootstrap + docker import, with this host's CA certificates
    local image=$1 t0=$SECONDS root
    command -v debootstrap >/dev/null || apt_install debootstrap
    need_root "debootstrap"
    root="$(mktemp -d /var/tmp/specdec-rootfs.XXXXXX)"
    debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
        || { tail -20 "$root.log" >&2; die "debootstrap failed"; }
    cat > "$root/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
        chroot "$root" update-ca-certificates >/dev/null 2>&1
    fi
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*.log
    tar -C "$root" -c . | docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' - "$image" >/dev/null
    rm -rf "$root" "$root.log"
    say "$image: built by debootstrap in $((SECONDS - t0)) s"
}

build_standin() {   # deploy/images/<name>/Dockerfile, FROM debian:bookworm-slim
    local image=$1 t0=$SECONDS dir
    dir="$HERE/images/${image%%:*}"
    DOCKER_BUILDKIT=1 docker build -q -t "$image" "$dir" >/dev/null
    say "$image: stand-in built from deploy/images/${image%%:*} in $((SECONDS - t0)) s"
}

up() {
    command -v docker >/dev/null || install_engine
    install_engine
    install_plugins
    start_dockerd
    pull_or debian:bookworm-slim build_debian
    pull_or python:3.11-slim build_standin
    pull_or redis:7-bookworm build_standin
}

down() {
    if [ ! -f "$STATE/dockerd.pid" ]; then say "no dockerd started by docker_env.sh; nothing to stop"; return; fi
    local pid; pid="$(cat "$STATE/dockerd.pid")"
    if kill -0 "$pid" 2>/dev/null; then
        say "stopping dockerd (pid $pid)"
        kill -TERM "$pid"
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -0 "$pid" 2>/dev/null && { say "dockerd still up after 30 s: SIGKILL"; kill -KILL "$pid"; sleep 1; }
    fi
    # containerd started by dockerd exits with it; a leftover shim would keep a container alive
    # What dockerd leaves behind: its iptables rules and chains (filter and nat), docker0 and compose bridges.
    # A grep that matches nothing (already clean) must not end the script under pipefail.
    set +o pipefail
    local table rule
    for table in filter nat; do
        iptables -t "$table" -S 2>/dev/null | grep -E -- '-A .*(DOCKER|docker0|br-[0-9a-f]{12})' | while read -r rule; do
            # shellcheck disable=SC2086
            iptables -t "$table" ${rule/-A/-D} 2>/dev/null || true
        done
        iptables -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^DOCKER/ {print $2}' | while read -r chain; do
            iptables -t "$table" -F "$chain" 2>/dev/null || true
        done
        iptables -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^DOCKER/ {print $2}' | while read -r chain; do
            iptables -t "$table" -X "$chain" 2>/dev/null || true
        done
    done
    local policy; policy="$(cat "$STATE/forward_policy" 2>/dev/null || true)"
    [ -n "$policy" ] && iptables -P FORWARD "$policy"
    if [ ! -f "$STATE/had_docker0" ] && ip link show docker0 >/dev/null 2>&1; then ip link delete docker0; fi
    ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' | grep -E '^br-[0-9a-f]{12}$' | while read -r br; do
        ip link delete "$br" || true
    done
    rm -rf "$STATE"
    say "dockerd stopped; iptables chains, docker0 and bridges removed (FORWARD policy ${policy:-unchanged})"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
