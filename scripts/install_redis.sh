#!/usr/bin/env bash
# Install redis-server and redis-cli for the remote tier's tests (Debian, root).
# Does nothing when both are already on PATH. The tests run their own servers on free
# loopback ports, so the packaged service is kept from starting.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install_redis.sh: needs root (apt-get install redis-server)" >&2
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
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null

for tool in redis-server redis-cli; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "install_redis.sh: the redis-server package did not put $tool on PATH" >&2
    exit 1
  fi
done
redis-server --version
