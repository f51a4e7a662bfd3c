#!/usr/bin/env bash
# Install a Debian package whose programs the tests run, unless they are on PATH (root).
#   bash scripts/install_debian.sh PACKAGE PROGRAM...
# The tests run their own instances on free loopback ports, so the packaged service is
# kept from starting.
set -euo pipefail
package="$1"
shift
missing=0
for tool in "$@"; do
  command -v "$tool" >/dev/null 2>&1 || missing=1
done
if [ "$missing" -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install_debian.sh: needs root (apt-get install $package)" >&2
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
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" >/dev/null

for tool in "$@"; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "install_debian.sh: the $package package did not put $tool on PATH" >&2
    exit 1
  fi
done
