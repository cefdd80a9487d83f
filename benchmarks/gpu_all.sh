#!/usr/bin/env bash
# Both GPU measurements in one command of at most 10 minutes on one GPU, every job of both run, and one table of
# them at the end: gpu_check.py's checks first (the most important first), within GPU_CHECK_S (270 s by default;
# what it does not use goes to gpu_speed), then gpu_speed.py's jobs (one fresh process per way, the jobs in
# order within it, the most important first) within the rest of GPU_ALL_S (570 s: 30 s of the 10 minutes are
# kept for the table and the hard limits' grace). Each keeps its own budget (gpu_check's Budget: nothing starts
# without the time to run, a child gets the time left as its timeout); hard limits behind both. Without a CUDA
# GPU both say so and exit 0.
#
#   bash benchmarks/gpu_all.sh            # exit status: 1 if either failed
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
GPU_ALL_S=${GPU_ALL_S:-570}
GPU_CHECK_S=${GPU_CHECK_S:-270}
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_all: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check or measure"
    exit 0
fi
started=$SECONDS
rows=$(mktemp)
trap 'rm -f "$rows"' EXIT
timeout --signal=TERM --kill-after=5 $((GPU_CHECK_S + 15)) \
    "$PYTHON" benchmarks/gpu_check.py --budget "$GPU_CHECK_S" --table "$rows"
check=$?
# what gpu_check left of the whole, less 20 s for the hard limit's grace and the table
speed_s=$((GPU_ALL_S - (SECONDS - started) - 20))
timeout --signal=TERM --kill-after=5 $((speed_s + 15)) \
    "$PYTHON" benchmarks/gpu_speed.py --budget "$speed_s" --table "$rows"
speed=$?
echo
echo "gpu_all: both scripts in one table ($((SECONDS - started)) s)"
"$PYTHON" benchmarks/gpu_check.py --one_table "$rows"
echo "gpu_all: gpu_check exit $check, gpu_speed exit $speed"
[ "$check" -eq 0 ] && [ "$speed" -eq 0 ]
