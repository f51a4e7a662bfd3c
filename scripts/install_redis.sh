#!/usr/bin/env bash
# Install redis-server and redis-cli for the remote tier's tests (Debian, root).
# Does nothing when both are already on PATH.
set -euo pipefail
bash "$(dirname "${BASH_SOURCE[0]}")/install_debian.sh" redis-server redis-server redis-cli
redis-server --version
