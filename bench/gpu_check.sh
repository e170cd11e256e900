#!/usr/bin/env bash
# Kernel check for a CUDA machine that has torch and triton but no network; installs nothing.
#
#   bench/gpu_check.sh            kernel tests on CUDA tensors, then the kernel benchmark with pinned slabs
#   bench/gpu_check.sh --dry-run  the same steps on CPU (interpreter tests, --quick torch-only benchmark)
#
# Results (JSON, PNG, logs) go to $OUT when set, else bench/results/. Budget: under 5 minutes on an
# H100/H200 (tests ~1 min incl. Triton compiles, benchmark ~2 min). PYTHON picks the interpreter
# (default: .venv/bin/python when present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
export KVTRITON_BENCH_OUT="$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PYTHON" - <<'PY' | tee "$RESULTS/gpu_check_env.txt"
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name(0)}")
PY

if [[ "$DRY_RUN" == 0 ]] && ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device; run with --dry-run for the CPU rehearsal" >&2
    exit 2
fi

# 1. Kernel tests. Dispatch is per device: CUDA tensors run the compiled kernel, CPU tensors the
#    interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so both are covered in one run.
echo "== kernel tests"
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_kernels_*.py 2>&1 | tee "$RESULTS/gpu_check_tests.txt"

# 2. Benchmark. No TRITON_INTERPRET here: timings must come from compiled kernels.
echo "== kernel benchmark"
if [[ "$DRY_RUN" == 1 ]]; then
    env -u TRITON_INTERPRET timeout 120 "$PYTHON" -m bench.kernels --quick --device cpu --name gpu_check_kernels_dry_run \
        2>&1 | tee "$RESULTS/gpu_check_bench.txt"
else
    env -u TRITON_INTERPRET timeout 200 "$PYTHON" -m bench.kernels --device cuda --repeats 5 --name gpu_check_kernels \
        2>&1 | tee "$RESULTS/gpu_check_bench.txt"
fi
env -u TRITON_INTERPRET timeout 60 "$PYTHON" -m bench.kernels --ptx --name gpu_check_kernels 2>&1 | tee "$RESULTS/gpu_check_ptx.txt"
echo "gpu_check: done; results in $RESULTS"
