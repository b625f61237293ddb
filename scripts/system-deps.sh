#!/usr/bin/env bash
# System packages the tests need, installed only when missing (apt-get, as root or via sudo):
# tmux (attach tests), prometheus and promtool (a real Prometheus scrapes the exporter),
# docker-compose (validates docker-compose.yml; no Docker engine is needed or installed),
# iproute2 (`ip`: the tests that build hosts from network namespaces, run as root).
set -euo pipefail
need=()
command -v tmux >/dev/null 2>&1 || need+=(tmux)
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || need+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# no recommends: they would add a Docker engine and a node exporter nothing here uses
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
