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
# LIMIT: requests of the Mooncake trace to replay (empty: all 3,993). TESTS=0 skips the tests.
# DEVICES: the devices compared (default "cuda torch:cpu cpu": torch on the GPU, the same torch
# code on the CPU, and numpy, the CPU's path; "cpu" alone is a dry run without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-bench/.wheels}"
VENV="${VENV:-/tmp/kvtrace-gpu-check}"
OUT="${OUT:-/tmp/kvtrace-gpu-check-out}"
mkdir -p "$OUT"

echo "== python and torch"
"$PY" - <<'PYEOF' || { echo "gpu_check: this Python has no usable torch"; exit 2; }
import sys, torch
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PYEOF

echo "== environment ($VENV: the machine's torch, the wheels from $WHEELS, no index)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV" || exit 2
fi
"$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" -r requirements/gpu-check.txt || exit 2
export PYTHONPATH="$REPO"  # kvtrace from this checkout, not installed
VPY="$VENV/bin/python"
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
    KVTRACE_DEVICE=$dev "$VPY" -m pytest -q -p no:cacheprovider tests/cache tests/engine \
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
