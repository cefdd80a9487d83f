#!/usr/bin/env bash
# Both GPU measurements in one command of at most 10 minutes: gpu_check.py's checks within GPU_CHECK_S (300 s by
# default, most important first), then gpu_speed.py's side-by-side table within the rest (GPU_SPEED_S, 240 s),
# each keeping its own budget (gpu_check's Budget: nothing starts without the time to run, a child gets the time
# left as its timeout) and printing its table; hard limits behind both. Without a CUDA GPU both say so and exit 0.
#
#   bash benchmarks/gpu_all.sh            # exit status: 1 if either failed
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
GPU_CHECK_S=${GPU_CHECK_S:-300}
GPU_SPEED_S=${GPU_SPEED_S:-240}
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_all: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check or measure"
    exit 0
fi
timeout --signal=TERM --kill-after=10 $((GPU_CHECK_S + 20)) "$PYTHON" benchmarks/gpu_check.py --budget "$GPU_CHECK_S"
check=$?
timeout --signal=TERM --kill-after=10 $((GPU_SPEED_S + 20)) "$PYTHON" benchmarks/gpu_speed.py --budget "$GPU_SPEED_S"
speed=$?
echo "gpu_all: gpu_check exit $check, gpu_speed exit $speed"
[ "$check" -eq 0 ] && [ "$speed" -eq 0 ]
