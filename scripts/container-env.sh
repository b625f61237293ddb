#!/usr/bin/env bash
# Prepares this machine (Debian 12, root, no Docker engine, no systemd, Docker Hub out of
# reach) to build and run the project's real Dockerfile and docker-compose.yml with
# Debian's podman, driven by Debian's docker-compose (v1) through podman's Docker API:
#
#   1. apt packages (only those missing): podman, runc, netavark, docker-compose, ...
#   2. a containers.conf this sandbox accepts: runc (crun refuses the hybrid cgroup
#      layout), cgroupfs (no systemd), ulimits under the hard limits (no CAP_SYS_RESOURCE,
#      podman's default nofile fails with "setrlimit RLIMIT_NOFILE: Operation not permitted")
#   3. TEST-ONLY IMAGES, never to be published, standing in for what cannot be pulled:
#      - docker.io/library/python:3.11-slim-bookworm: Debian bookworm minbase + python3,
#        pip, venv (mmdebstrap, from this machine's apt sources), with this machine's pip
#        configuration, CA certificates (an intercepting proxy) and local wheel directory
#        (the CPU torch wheel), and without the EXTERNALLY-MANAGED marker
#      - docker.io/prom/prometheus:v2.42.0: Debian's prometheus 2.42 on that base
#        (tests/containers/prometheus/Containerfile)
#   4. `podman system service` on a unix socket, for DOCKER_HOST
#
# Idempotent (each step is skipped when already done) and serialised with a lock. Writes
# the variables callers need to $OFFLOOP_CONTAINERS_DIR/env (default
# /tmp/offloop-containers/env) and prints that file:
#     . /tmp/offloop-containers/env
#     podman build -t offloop:latest --build-arg TORCH_INDEX_URL="$OFFLOOP_TORCH_INDEX_URL" .
#     docker-compose ... up        (DOCKER_HOST points at the podman socket)
#
# Exit codes: 0 ready; 77 this machine cannot host podman (not root, no apt-get,
# podman cannot start containers): one line on stderr says why (tests skip); 1 any
# other failure (tests should fail: image bootstrap, build, service).
set -euo pipefail

STATE_DIR=${OFFLOOP_CONTAINERS_DIR:-/tmp/offloop-containers}
SOCK=${OFFLOOP_PODMAN_SOCK:-/run/offloop-podman.sock}
BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm
PROM_IMAGE=docker.io/prom/prometheus:v2.42.0
TORCH_PIN=torch==2.13.0
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROM_CONTEXT=$REPO_ROOT/tests/containers/prometheus
IMAGE_PIP_CONF=/etc/pip.conf  # where the base image gets this machine's pip settings

log() { printf '[container-env] %s\n' "$*" >&2; }
skip() { printf 'container-env: cannot run podman here: %s\n' "$*" >&2; exit 77; }
die() { printf 'container-env: %s\n' "$*" >&2; exit 1; }
timed() {  # timed LABEL CMD...: run CMD, log how long it took
  local label=$1 t0=$SECONDS; shift
  "$@"
  log "$label took $((SECONDS - t0))s"
}

# --- preconditions -----------------------------------------------------------------------
[ "$(uname -s)" = Linux ] || skip "not Linux"
[ "$(id -u)" -eq 0 ] || skip "must run as root (rootful podman; uid is $(id -u))"
mkdir -p "$STATE_DIR"
exec 9>"$STATE_DIR/lock"
flock -w 1800 9 || die "another container-env.sh held $STATE_DIR/lock for 30 minutes"

# --- 1. packages -------------------------------------------------------------------------
PACKAGES=(podman runc uidmap fuse-overlayfs slirp4netns netavark aardvark-dns iptables
          mmdebstrap docker-compose prometheus curl iproute2)
install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
      || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || skip "packages missing (${missing[*]}) and no apt-get"
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 apt-get update -qq >"$STATE_DIR/apt.log" 2>&1 \
    || die "apt-get update failed (see $STATE_DIR/apt.log)"
  # no recommends: they would pull in a Docker engine, a node exporter, crun, ...
  timeout 1200 apt-get install -y -qq --no-install-recommends "${missing[@]}" \
      >>"$STATE_DIR/apt.log" 2>&1 \
    || die "apt-get install ${missing[*]} failed (see $STATE_DIR/apt.log)"
}
timed "apt step" install_packages

# --- 1b. a static MAC on podman's bridges ------------------------------------------------
# bookworm's netavark 1.4 leaves a bridge's MAC to the kernel, which takes the lowest MAC
# of the attached veths: when a container leaves the network the bridge's MAC changes, and
# the other containers' ARP entries for the gateway (aardvark-dns's address) point at the
# old one, so DNS is silent for 15-100 s (containers/netavark#833, fixed in 1.9 by a static
# MAC). This wrapper runs Debian's netavark, then pins every podman bridge's MAC (an
# address set explicitly is one the kernel no longer recalculates), as netavark 1.9 does.
HELPERS=$STATE_DIR/helpers
write_netavark_wrapper() {
  cat >"$HELPERS/netavark.new" <<'EOF'
#!/bin/sh
# written by scripts/container-env.sh: Debian's netavark, then static MACs on its bridges
/usr/lib/podman/netavark "$@"
status=$?
if [ "$status" -eq 0 ]; then
  for dev in /sys/class/net/podman*; do
    [ -d "$dev/bridge" ] && [ "$(cat "$dev/addr_assign_type")" != 3 ] \
      && ip link set dev "${dev##*/}" address "$(cat "$dev/address")" 2>/dev/null
  done
fi
exit "$status"
EOF
  chmod 0755 "$HELPERS/netavark.new"
  mv "$HELPERS/netavark.new" "$HELPERS/netavark"
}
mkdir -p "$HELPERS"
write_netavark_wrapper

# --- 2. configuration --------------------------------------------------------------------
export CONTAINERS_CONF=$STATE_DIR/containers.conf
cat >"$CONTAINERS_CONF.new" <<EOF
# written by scripts/container-env.sh
[containers]
# podman's default (nofile=1048576) exceeds the hard limit and cannot be raised here
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
log_driver = "k8s-file"

[engine]
# crun refuses the hybrid cgroup v1/v2 layout; no systemd, so cgroupfs and file events
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
# step 1b's netavark first; the rest is podman's default search path (its digest here: a
# change to it is a change of configuration, which restarts the service)
# netavark wrapper $(sha256sum "$HELPERS/netavark" | cut -c1-16)
helper_binaries_dir = ["$HELPERS", "/usr/local/libexec/podman", "/usr/local/lib/podman",
                       "/usr/libexec/podman", "/usr/lib/podman"]

[network]
network_backend = "netavark"
EOF
CONF_CHANGED=""  # then a running service was started under another configuration
cmp -s "$CONTAINERS_CONF.new" "$CONTAINERS_CONF" || CONF_CHANGED=1
mv "$CONTAINERS_CONF.new" "$CONTAINERS_CONF"

# storage: native overlay when the kernel allows it here, else fuse-overlayfs, else vfs
choose_storage() {
  local f=$STATE_DIR/storage.conf d driver=vfs opts=""
  if [ -s "$f" ]; then export CONTAINERS_STORAGE_CONF=$f; return 0; fi
  d=$(mktemp -d "$STATE_DIR/ovl.XXXXXX")
  mkdir -p "$d"/{l,u,w,m}
  if mount -t overlay overlay -o "lowerdir=$d/l,upperdir=$d/u,workdir=$d/w" "$d/m" 2>/dev/null; then
    umount "$d/m"; driver=overlay
  elif [ -c /dev/fuse ] && command -v fuse-overlayfs >/dev/null \
       && fuse-overlayfs -o "lowerdir=$d/l,upperdir=$d/u,workdir=$d/w" "$d/m" 2>/dev/null; then
    umount "$d/m"; driver=overlay; opts='mount_program = "/usr/bin/fuse-overlayfs"'
  fi
  rm -rf "$d"
  # an existing store keeps its driver: never switch under it
  if [ -e /var/lib/containers/storage/overlay ] && [ "$driver" = vfs ]; then
    die "/var/lib/containers/storage uses overlay, which no longer mounts here"
  fi
  {
    echo '# written by scripts/container-env.sh'
    echo '[storage]'
    echo "driver = \"$driver\""
    echo 'runroot = "/run/containers/storage"'
    echo 'graphroot = "/var/lib/containers/storage"'
    if [ -n "$opts" ]; then echo '[storage.options.overlay]'; echo "$opts"; fi
  } >"$f"
  log "storage driver: $driver${opts:+ (fuse-overlayfs)}"
  export CONTAINERS_STORAGE_CONF=$f
}
choose_storage

podman info >"$STATE_DIR/podman-info.log" 2>&1 \
  || skip "podman info fails: $(tail -n 1 "$STATE_DIR/podman-info.log")"

# --- pip settings for the base image -------------------------------------------------------
# The index pip uses here (its default unless configured): torch's own index is out of
# reach, so image builds pass it as TORCH_INDEX_URL; the CPU wheel itself comes from the
# local find-links directory copied into the base image (pip prefers 2.13.0+cpu to 2.13.0).
pip_get() {  # pip_get KEY: value from PIP_* or pip's config files, empty when unset
  local env_name val
  env_name=PIP_$(echo "${1#*.}" | tr 'a-z-' 'A-Z_')
  val=${!env_name:-}
  [ -n "$val" ] || val=$(python3 -m pip config get "$1" 2>/dev/null || true)
  printf '%s' "$val"
}
TORCH_INDEX_URL=$(pip_get global.index-url)
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}
FIND_LINKS=()   # local directories only: the ones copied into the image
for fl in $(pip_get global.find-links); do
  fl=${fl#file://}
  [ -d "$fl" ] && FIND_LINKS+=("$fl")
done
PIP_CA=$(pip_get global.cert)
PIP_CA=${PIP_CA:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}
PIP_TIMEOUT=$(pip_get global.default-timeout)

# --- 3a. base image ----------------------------------------------------------------------
image_exists() { podman image exists "$1"; }

debian_sources() {  # this machine's enabled Debian apt sources, as mmdebstrap arguments
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    grep -Eq '^[^#]*(debian\.org|/debian(-security)?[ /]|/debian(-security)?$)' "$f" && echo "$f"
  done
}

bootstrap_base() {
  local work tarball pipconf srcs=() fl
  mapfile -t srcs < <(debian_sources)
  [ ${#srcs[@]} -gt 0 ] || srcs=("deb http://deb.debian.org/debian bookworm main"
                                  "deb http://deb.debian.org/debian bookworm-updates main"
                                  "deb http://deb.debian.org/debian-security bookworm-security main")
  work=$(mktemp -d "$STATE_DIR/base.XXXXXX")
  tarball=$work/base.tar
  pipconf=$work/pip.conf
  {
    echo '# this machine'\''s pip settings (scripts/container-env.sh; test-only image)'
    echo '[global]'
    [ "$TORCH_INDEX_URL" = https://pypi.org/simple ] || echo "index-url = $TORCH_INDEX_URL"
    [ ${#FIND_LINKS[@]} -eq 0 ] || echo "find-links = ${FIND_LINKS[*]}"
    echo "cert = /etc/ssl/certs/ca-certificates.crt"
    [ -z "$PIP_TIMEOUT" ] || echo "default-timeout = $PIP_TIMEOUT"
  } >"$pipconf"
  local hooks=(
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED'
    --customize-hook="upload $pipconf $IMAGE_PIP_CONF"
    --customize-hook='mkdir -p "$1"/usr/local/share/ca-certificates'
  )
  local crt
  for crt in /usr/local/share/ca-certificates/*.crt; do
    [ -f "$crt" ] && hooks+=(--customize-hook="upload $crt /usr/local/share/ca-certificates/$(basename "$crt")")
  done
  hooks+=(--customize-hook='chroot "$1" update-ca-certificates >/dev/null')
  if [ -f "$PIP_CA" ] && [ "$PIP_CA" != /etc/ssl/certs/ca-certificates.crt ]; then
    # a bundle outside the usual place: append it, so the image trusts what pip trusts here
    hooks+=(--customize-hook="cat '$PIP_CA' >> \"\$1\"/etc/ssl/certs/ca-certificates.crt")
  fi
  for fl in "${FIND_LINKS[@]}"; do
    hooks+=(--customize-hook="mkdir -p \"\$1\"$fl" --customize-hook="sync-in $fl $fl")
  done
  log "bootstrapping $BASE_IMAGE (test-only) from ${srcs[*]}"
  timeout 1200 mmdebstrap --variant=minbase --mode=root --format=tar --skip=output/dev \
      --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      "${hooks[@]}" bookworm "$tarball" "${srcs[@]}" >"$STATE_DIR/mmdebstrap.log" 2>&1 \
    || die "mmdebstrap failed (see $STATE_DIR/mmdebstrap.log)"
  podman import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' \
      --change 'LABEL org.opencontainers.image.description="TEST-ONLY stand-in for python:3.11-slim-bookworm (offloop scripts/container-env.sh)"' \
      --change 'CMD ["python3"]' \
      "$tarball" "$BASE_IMAGE" >/dev/null 2>"$STATE_DIR/import.log" \
    || die "podman import failed: $(tail -n 3 "$STATE_DIR/import.log")"
  rm -rf "$work"
}
if ! image_exists "$BASE_IMAGE"; then timed "base image bootstrap" bootstrap_base; fi

# a container must start, and pip inside must find the pinned CPU torch at that index
check_base() {
  local out
  out=$(timeout 600 podman run --rm "$BASE_IMAGE" sh -c \
        "pip download --no-deps --quiet -d /tmp/w '$TORCH_PIN' --index-url '$TORCH_INDEX_URL' && ls /tmp/w" 2>&1) \
    || { if podman run --rm "$BASE_IMAGE" true >/dev/null 2>&1; then
           die "pip cannot download $TORCH_PIN in $BASE_IMAGE: $(tail -n 3 <<<"$out")"
         fi
         skip "containers do not start: $(tail -n 1 <<<"$out")"; }
  grep -q '^torch-' <<<"$out" || die "no torch wheel downloaded in $BASE_IMAGE: $out"
  log "in $BASE_IMAGE, $TORCH_PIN from $TORCH_INDEX_URL gives $(grep '^torch-' <<<"$out")"
}
if [ ! -e "$STATE_DIR/base-checked" ] || [ "$(cat "$STATE_DIR/base-checked")" != "$(podman image inspect -f '{{.Id}}' "$BASE_IMAGE")" ]; then
  timed "base image check" check_base
  podman image inspect -f '{{.Id}}' "$BASE_IMAGE" >"$STATE_DIR/base-checked"
fi

# --- 3b. prometheus image ----------------------------------------------------------------
build_prometheus() {
  [ -f "$PROM_CONTEXT/Containerfile" ] || die "missing $PROM_CONTEXT/Containerfile"
  timeout 900 podman build -q -t "$PROM_IMAGE" -f "$PROM_CONTEXT/Containerfile" "$PROM_CONTEXT" \
      >"$STATE_DIR/prometheus-build.log" 2>&1 \
    || die "building $PROM_IMAGE failed (see $STATE_DIR/prometheus-build.log)"
}
if ! image_exists "$PROM_IMAGE"; then timed "prometheus image" build_prometheus; fi

# --- 4. Docker API socket ----------------------------------------------------------------
ping_sock() { curl -fsS --max-time 5 --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1; }
start_service() {
  local pid i
  if [ -f "$STATE_DIR/service.pid" ]; then
    pid=$(cat "$STATE_DIR/service.pid")
    # a started but unresponsive service of ours: end it (by its id) before a new one
    if kill -0 "$pid" 2>/dev/null && grep -q podman "/proc/$pid/cmdline" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true; sleep 1
    fi
  fi
  rm -f "$SOCK"
  # from /: conmon starts each container from the service's working directory, and a
  # caller's (a CI clone) may be deleted while the service lives on ("write child: broken pipe")
  CONTAINERS_CONF=$CONTAINERS_CONF CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF \
    setsid nohup env -C / podman system service --time=0 "unix://$SOCK" \
      >"$STATE_DIR/service.log" 2>&1 </dev/null 9>&- &  # 9: the lock stays ours
  echo $! >"$STATE_DIR/service.pid"
  for i in $(seq 1 60); do
    ping_sock && return 0
    kill -0 "$(cat "$STATE_DIR/service.pid")" 2>/dev/null \
      || die "podman system service exited: $(tail -n 3 "$STATE_DIR/service.log")"
    sleep 0.5
  done
  die "podman system service did not answer on $SOCK within 30s (see $STATE_DIR/service.log)"
}
# a service whose working directory was deleted answers pings but starts no container
service_cwd_gone() {
  [ -f "$STATE_DIR/service.pid" ] \
    && readlink "/proc/$(cat "$STATE_DIR/service.pid")/cwd" 2>/dev/null | grep -q ' (deleted)$'
}
if [ -n "$CONF_CHANGED" ] && [ -f "$STATE_DIR/service.pid" ]; then
  log "containers.conf changed: restarting the service"
  timed "podman service restart" start_service
elif service_cwd_gone; then
  log "the service's working directory was deleted: restarting the service"
  timed "podman service restart" start_service
elif ! ping_sock; then
  timed "podman service start" start_service
fi

# --- environment for callers -------------------------------------------------------------
ENV_FILE=$STATE_DIR/env
cat >"$ENV_FILE.new" <<EOF
# written by scripts/container-env.sh: source it before podman / docker-compose
export CONTAINERS_CONF=$CONTAINERS_CONF
export CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF
export DOCKER_HOST=unix://$SOCK
export OFFLOOP_TORCH_INDEX_URL=$TORCH_INDEX_URL
# docker-compose v1: build through the API (podman's), long reads (60 s stop grace periods)
export COMPOSE_DOCKER_CLI_BUILD=0
export DOCKER_BUILDKIT=0
export COMPOSE_HTTP_TIMEOUT=600
EOF
mv "$ENV_FILE.new" "$ENV_FILE"
log "ready; variables in $ENV_FILE"
cat "$ENV_FILE"
