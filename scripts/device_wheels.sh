#!/usr/bin/env bash
# Wheels for a GPU machine that has torch and pytest but no registry (the device tool's
# H200: Python 3.12, x86_64): the requirements of mmcache and its tests that it lacks,
# downloaded here into .whl/ (git ignores it: carry it, run(..., carry=[".whl"])).
# benchmarks/gpu_suite.sh installs them there.
#   bash scripts/device_wheels.sh [python version, default 3.12]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version="${1:-3.12}"
python="${PYTHON:-python3}"
rm -rf .whl
"$python" -m pip download -q --disable-pip-version-check --dest .whl --only-binary=:all: \
  --python-version "$version" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  "cachetools>=5" "pydantic-settings>=2.3" "pytest-asyncio>=0.24"
# What the machine has already (its own pytest and plugins stay the ones that run).
for name in pytest pluggy iniconfig packaging pygments typing_extensions; do
  rm -f .whl/"$name"-[0-9]*.whl
done
ls .whl
