#!/usr/bin/env bash
# Install a Prometheus server and promtool for tests/api/test_prometheus_server.py (Debian, root).
# Does nothing when both are already on PATH.
set -euo pipefail
bash "$(dirname "${BASH_SOURCE[0]}")/install_debian.sh" prometheus prometheus promtool
prometheus --version 2>&1 | head -n 1
