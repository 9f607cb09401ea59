#!/usr/bin/env bash
# The CUDA-path checks and a short bench, inside 8 minutes (issue 14 item 7, issue 9 item 4).
#
#   scripts/gpu_check.sh                # cuda when present, else the CPU-safe parts on the CPU
#   scripts/gpu_check.sh --device cpu   # force the CPU (what CI runs, with --quick)
#   scripts/gpu_check.sh --quick        # tiny target, few tokens: checks the script itself
#
# Steps:
#  1. device facts: torch/CUDA versions, native bfloat16, TF32 flags (specgen turns TF32 off for float32);
#  2. tests/test_gpu_check.py on the device: tree forward vs per-path forwards, greedy equality for every
#     drafter kind, learned heads in bfloat16, exactness on tiny models (chi-square), and greedy identity of
#     the float32 verify pass with single-token steps with TF32 off -- the measurement behind the
#     "greedy"/"exact" claim on CUDA (specgen.models.cuda_condition); then tests/test_syncs.py;
#  3. the bench (scripts/gpu_check.py): plain vs speculative tokens/s, host reads per round, greedy identity;
#     then 8 prompts at batch 8 (plain and speculative) against one at a time, rows = single-request greedy.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate

DEVICE=""
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --device DEV, --quick)" >&2; exit 2 ;;
  esac
done
if [ -z "$DEVICE" ]; then
  DEVICE=$(python -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
fi
export SPECGEN_CHECK_DEVICE="$DEVICE"
start=$SECONDS

echo "== gpu_check: device=$DEVICE"
python - "$DEVICE" <<'EOF'
import sys, torch
from specgen.models import native_bfloat16, resolve_dtype
device = torch.device(sys.argv[1])
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, available {torch.cuda.is_available()}")
if device.type == "cuda":
    print(f"{torch.cuda.get_device_name(device)}; native bfloat16 {native_bfloat16(device)}; "
          f"dtype=auto -> {resolve_dtype('auto', device)}")
print(f"TF32 before specgen: matmul {torch.backends.cuda.matmul.allow_tf32}, cudnn {torch.backends.cudnn.allow_tf32}")
EOF

if [ "$QUICK" = 0 ]; then
  echo "== gpu_check: CUDA-path tests (tests/test_gpu_check.py, tests/test_syncs.py)"
  # one process (-p no:xdist) on the one device (no worker per CPU starting torch and CUDA within the budget)
  timeout 300 python -m pytest -q -p no:xdist -p no:cacheprovider tests/test_gpu_check.py tests/test_syncs.py
  echo "== gpu_check: bench"
  timeout 150 python scripts/gpu_check.py --device "$DEVICE" --tokens 64
else
  echo "== gpu_check: bench (quick)"
  timeout 60 python scripts/gpu_check.py --device "$DEVICE" --target tiny --dtypes float32 --tokens 16
fi
echo "== gpu_check: done in $((SECONDS - start)) s"
