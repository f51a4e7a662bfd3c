#!/usr/bin/env bash
# Install Grafana's own dashboard schema (npm @grafana/schema) and the TypeScript compiler
# that checks grafana/mmcache.json against it (tests/api/test_dashboard_schema.py), into
# build/grafana-schema (or $MMCACHE_GRAFANA_SCHEMA_DIR). Does nothing when both are there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${MMCACHE_GRAFANA_SCHEMA_DIR:-$root/build/grafana-schema}"

if [ -x "$dir/node_modules/.bin/tsc" ] && [ -f "$dir/node_modules/@grafana/schema/package.json" ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "install_grafana_schema.sh: needs Node.js and npm (Debian: apt-get install nodejs npm)" >&2
  exit 1
fi
mkdir -p "$dir"
echo "install_grafana_schema.sh: installing @grafana/schema and typescript into $dir" >&2
npm install --prefix "$dir" --silent --no-audit --no-fund --no-save \
  @grafana/schema@13.2.3 typescript@5.9.3
