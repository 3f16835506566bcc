#!/usr/bin/env bash
# What a session lent a GPU machine runs there, in one go (docs/gpu.md): build colo from this checkout
# (no network there: no build isolation, no dependencies), then `python -m colo.gpu_check` and the
# tests marked cuda. Logs and the JSON report go to $1 (default: gpu-check/).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
{
  nvidia-smi -L
  "$py" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
} 2>&1 | tee "$out/machine.txt"
echo "== building colo"
if ! "$py" -m pip install -e . --no-deps --no-build-isolation > "$out/build.log" 2>&1; then
  tail -40 "$out/build.log"; echo "== build failed"; exit 1
fi
echo "== python -m colo.gpu_check"
timeout 300 "$py" -m colo.gpu_check --json "$out/gpu-check.json" 2>&1 | tee "$out/gpu-check.log" | tail -60
check_status=${PIPESTATUS[0]}
echo "== python -m pytest -m cuda"
timeout 240 "$py" -m pytest -m cuda -p no:cacheprovider -q -rA 2>&1 | tee "$out/pytest-cuda.log" | tail -60
test_status=${PIPESTATUS[0]}
echo "== gpu_check exit $check_status, pytest -m cuda exit $test_status"
[ "$check_status" -eq 0 ] && [ "$test_status" -eq 0 ]
