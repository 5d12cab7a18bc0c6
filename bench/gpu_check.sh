#!/usr/bin/env bash
# The engine on a GPU: the cache and engine tests and bench/engine_replay.py, on cuda and on
# cpu, with both times and whether the two runs' digests are equal (content is exact
# integer arithmetic, so they must be).
#
# Needs only this repository, a Python with a CUDA torch (the machine's own), and the
# wheels of requirements/gpu-check.txt in a folder (bash bench/gpu_wheels.sh fetches them
# where a registry is reachable); nothing is downloaded here. Usage:
#
#   PYTHON=/path/to/python WHEELS=bench/.wheels LIMIT= bash bench/gpu_check.sh
#
# LIMIT: requests of the Mooncake trace to replay (empty: all 3,993). TESTS=0 skips the tests;
# PYTEST_ARGS adds to pytest's arguments (e.g. "-n 8 --dist loadgroup" where xdist is there).
# DEVICES: the devices compared (default "cuda torch:cpu cpu": torch on the GPU, the same torch
# code on the CPU, and numpy, the CPU's path; "cpu" alone is a dry run without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-bench/.wheels}"
SITE="${SITE:-/tmp/kvtrace-gpu-check-site}"
OUT="${OUT:-/tmp/kvtrace-gpu-check-out}"
mkdir -p "$OUT"

echo "== python and torch"
"$PY" - <<'PYEOF' || { echo "gpu_check: this Python has no usable torch"; exit 2; }
import sys, torch
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PYEOF

echo "== environment (the machine's Python and torch; what it lacks from $WHEELS into $SITE, no index)"
# Only what is missing or outside its range: the machine's own packages (torch's numpy, its
# pytest plugins) stay in charge. (A venv would not do: the machine's python3 may itself be a
# venv, whose packages a --system-site-packages venv does not see.)
missing=$("$PY" - <<'PYEOF'
import re
from importlib.metadata import PackageNotFoundError, version
try:
    from packaging.specifiers import SpecifierSet
except ImportError:
    SpecifierSet = None
for line in open("requirements/gpu-check.txt"):
    req = line.split("#")[0].strip()
    if not req:
        continue
    name, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", req).groups()
    try:
        ok = SpecifierSet is not None and SpecifierSet(spec).contains(version(name), prereleases=True)
    except PackageNotFoundError:
        ok = False
    if not ok:
        print(req)
PYEOF
) || exit 2
if [ -n "$missing" ]; then
  echo "installing: $(echo $missing)"
  # shellcheck disable=SC2086  # one requirement a word
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" --target "$SITE" $missing || exit 2
fi
export PYTHONPATH="$REPO:$SITE"  # kvtrace from this checkout, not installed
VPY="$PY"

# The Cython kernels (kvtrace/compiled.py CYTHON), built in place as the install builds them, so
# the cpu path runs what a user's install runs. No mypyc: the cache runs on its sources here.
echo "== the Cython kernels (in place)"
"$VPY" - <<'PYEOF' || echo "gpu_check: the kernels did not build; the cpu path takes its numpy fallback"
import os, runpy, sys
from Cython.Build import cythonize
from setuptools import Distribution
from setuptools.command.build_ext import build_ext
names = runpy.run_path(os.path.join("kvtrace", "compiled.py"))["CYTHON"]
dist = Distribution({"ext_modules": cythonize([os.path.join(*m.split(".")) + ".pyx" for m in names], quiet=True)})
cmd = build_ext(dist)
cmd.inplace = True
cmd.ensure_finalized()
cmd.run()
from kvtrace import compiled
print("kernels:", compiled.kernels_mode())
PYEOF
DEVICES="${DEVICES:-cuda torch:cpu cpu}"
case " $DEVICES " in
  *" cuda "*) "$VPY" -c "import torch, kvtrace.engine.engine; assert torch.cuda.is_available(), 'no GPU visible'" \
                || exit 2 ;;
esac

status=0
if [ "${TESTS:-1}" != 0 ]; then
  for dev in $DEVICES; do
    echo "== cache and engine tests, KVTRACE_DEVICE=$dev"
    t0=$(date +%s%N)
    # (test_calibration fits the cost model to stored spans: DuckDB and OTel, no device code)
    KVTRACE_DEVICE=$dev "$VPY" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} tests/cache tests/engine \
      --ignore=tests/engine/test_calibration.py \
      > "$OUT/tests-$dev.txt" 2>&1
    rc=$?
    t1=$(date +%s%N)
    tail -3 "$OUT/tests-$dev.txt"
    echo "tests on $dev: exit $rc, $(( (t1 - t0) / 1000000 )) ms"
    [ "$rc" = 0 ] || status=1
  done
fi

LIMIT_ARGS=()
[ -n "${LIMIT:-}" ] && LIMIT_ARGS=(--limit "$LIMIT")
for dev in $DEVICES; do
  echo "== bench/engine_replay.py --device $dev ${LIMIT_ARGS[*]}"
  "$VPY" bench/engine_replay.py --no-profile --device "$dev" "${LIMIT_ARGS[@]}" \
    > "$OUT/replay-$dev.json" 2> "$OUT/replay-$dev.txt" || status=1
  cat "$OUT/replay-$dev.txt"
done

echo "== summary"
digests=""
for dev in $DEVICES; do
  grep -h "engine replay" "$OUT/replay-$dev.txt"
  digests="$digests $(sed -n 's/^digest //p' "$OUT/replay-$dev.txt")"
done
distinct=$(echo $digests | tr ' ' '\n' | sort -u | grep -c .)
if [ "$distinct" = 1 ]; then
  echo "digests equal: yes ($digests )"
else
  echo "digests equal: NO ($digests )"
  status=1
fi
exit $status
