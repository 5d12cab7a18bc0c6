#!/usr/bin/env bash
# Download the wheels bench/gpu_check.sh installs on a GPU machine without registry access
# (requirements/gpu-check.txt; torch is the machine's own) into one folder, for the
# Pythons a GPU machine may have. Run here, where the registry is reachable, then copy the
# repository with the folder:  bash bench/gpu_wheels.sh [DIR]  (default bench/.wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-bench/.wheels}"
PY="${PYTHON:-.venv/bin/python}"
VERSIONS="${PY_VERSIONS:-3.11 3.12 3.13}"  # kvtrace needs 3.11+ (tomllib)
mkdir -p "$DIR"
for v in $VERSIONS; do
  "$PY" -m pip download -q --only-binary=:all: --dest "$DIR" --python-version "$v" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -r requirements/gpu-check.txt
done
ls "$DIR" | wc -l | xargs -I{} echo "{} wheels in $DIR ($(du -sh "$DIR" | cut -f1))"
