#!/usr/bin/env bash
# System packages the tests need, installed only when missing (apt-get, as root or via sudo).
set -euo pipefail
need=()
command -v tmux >/dev/null 2>&1 || need+=(tmux)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq "${need[@]}"
