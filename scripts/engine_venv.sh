# Sourced by the engine install scripts: the project's venv (.venv or $MMCACHE_VENV, created
# if missing) with torch in it, and whether an engine is there already.
#   engine_venv PACKAGE VERSION PROBE [PYTHON FLAGS]   sets $py and $venv; returns 1 when
#     PACKAGE==VERSION is installed and PROBE (Python code) runs with those flags
engine_venv() {
  local package="$1" version="$2" probe="$3"
  local flags=("${@:4}")
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="${MMCACHE_VENV:-$root/.venv}"
  if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
  fi
  py="$venv/bin/python"
  if "$py" "${flags[@]}" -c "$probe" >/dev/null 2>&1 \
    && [ "$("$py" -c "import importlib.metadata as m; print(m.version('$package'))")" = "$version" ]; then
    return 1
  fi
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    # The engine's modules import torch: the same pinned build scripts/run would install.
    local torch_args
    read -r -a torch_args <<<"${MMCACHE_TORCH:-torch==2.13.0}"
    "$py" -m pip install -q --disable-pip-version-check "${torch_args[@]}"
  fi
  return 0
}
