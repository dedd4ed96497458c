#!/usr/bin/env bash
# The GPU checks in one call: bash benchmarks/gpu_check.sh OUTDIR [STEP ...]
# STEP: env calib kernels eager fused autopar compile (default: all, in that order).
# Each section of benchmarks/gpu_check.py runs in its own process under its own time limit,
# so one that fails or hangs leaves the others' figures; all append to OUTDIR/gpu_check.jsonl.
# PYTHON (default python3) is the interpreter that holds a CUDA torch and triton.
set -u
out=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR [env calib kernels eager fused autopar compile]}
shift
steps=${*:-env calib kernels eager fused autopar compile}
mkdir -p "$out"
rows=$out/gpu_check.jsonl
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
section() {
    local limit=$1
    shift
    local began=$SECONDS
    echo "== $* (limit ${limit} s)"
    timeout -k 10 "$limit" "$py" benchmarks/gpu_check.py --out "$rows" "$@" 2>>"$out/stderr.log" \
        | cut -c1-400
    echo "== exit ${PIPESTATUS[0]} after $((SECONDS - began)) s: $*"
}
nvidia-smi 2>&1 | head -20
for step in $steps; do
    case $step in
        env) section 40 --section env ;;
        calib) section 60 --section calib ;;
        kernels) section 170 --section kernels ;;
        eager|fused) section 80 --section train --variant "$step" ;;
        autopar) section 120 --section train --variant autopar ;;
        compile) section 170 --section train --variant compile ;;
        *) echo "unknown step $step"; exit 2 ;;
    esac
done
echo "== done in $SECONDS s"
