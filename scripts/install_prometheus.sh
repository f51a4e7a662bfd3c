#!/usr/bin/env bash
# Install a Prometheus server and promtool for tests/test_prometheus_server.py (Debian, root).
# Does nothing when both are already on PATH. The test runs its own instance on a free
# loopback port, so the packaged service is kept from starting.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install_prometheus.sh: needs root (apt-get install prometheus)" >&2
  exit 1
fi

# invoke-rc.d asks policy-rc.d whether to start services; 101 says "no". Only a file of
# ours is added and removed: an image's own policy stays as it was.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  trap 'rm -f "$policy"' EXIT
fi

apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null

for tool in prometheus promtool; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "install_prometheus.sh: the prometheus package did not put $tool on PATH" >&2
    exit 1
  fi
done
prometheus --version 2>&1 | head -n 1
