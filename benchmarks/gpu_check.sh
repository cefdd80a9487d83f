#!/usr/bin/env bash
# GPU smoke checks of stoker on one CUDA GPU, in at most 8 minutes: bf16 and fp16 training, TF32,
# torch.compile, FSDP2 in one process, 8-bit AdamW, 4-bit QLoRA, tokens/s + MFU of a ~110M Llama in bf16
# with and without torch.compile, checkpoint and resume, an fp16 overflow skipped by the scaler, chunked loss,
# packing (and its logged MFU), shared prefix, and DDP under torchrun (two ranks need two GPUs: with one, one rank
# runs and the two-rank agreement is reported "not run"); tokens/s and peak memory
# for each (see benchmarks/gpu_check.py).
# Without a CUDA GPU it says so and exits 0.
#
#   bash benchmarks/gpu_check.sh [--only bf16 qlora ...]
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check"
    exit 0
fi
# the Python script keeps its own budget of 480 s (each check and torchrun child within what is left);
# the hard limit is a backstop: on its SIGTERM the script prints its table and exits
exec timeout --signal=TERM --kill-after=10 500 "$PYTHON" benchmarks/gpu_check.py "$@"
