#!/usr/bin/env bash
# Kernel and engine check for a CUDA machine that has torch and triton (>= 3.2) but no network; installs nothing.
#
#   bench/gpu_check.sh            kernel and engine tests on CUDA, the kernel benchmark with pinned slabs,
#                                 the dma-vs-triton sweep (prints the crossover page size per direction)
#                                 and the engine host-cost benchmark
#   bench/gpu_check.sh --dry-run  the same steps on CPU (interpreter tests, --quick or CPU-rehearsal runs)
#
# Results (JSON, PNG, logs) go to $OUT when set, else bench/results/. Budget: at most 8 minutes on an
# H100/H200 (each step has its own timeout: tests 180 s incl. Triton compiles, benchmark 120 s,
# sweep 120 s, host cost 60 s, PTX 30 s).
# Every step runs even when an earlier one failed (a first GPU run should bring back all it can); the
# exit status is non-zero when any step failed. PYTHON picks the interpreter (default: .venv/bin/python
# when present, else python3).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
export KVTRITON_BENCH_OUT="$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CI=1  # the reproducible hypothesis profile (tests/conftest.py)
FAILED=()
step() {  # step NAME LOG COMMAND...: run, tee to LOG, remember a failure
    local name=$1 log=$2
    shift 2
    echo "== $name"
    "$@" 2>&1 | tee "$log"
    local status=${PIPESTATUS[0]}
    if [[ $status != 0 ]]; then
        echo "gpu_check: $name failed with status $status" | tee -a "$log" >&2
        FAILED+=("$name")
    fi
}

{ echo "memlock (ulimit -l): $(ulimit -l)"; "$PYTHON" - <<'PY'; } | tee "$RESULTS/gpu_check_env.txt"
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name(0)}")
PY

if [[ "$DRY_RUN" == 0 ]] && ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device; run with --dry-run for the CPU rehearsal" >&2
    exit 2
fi

# 1. Kernel, slab and engine tests. Dispatch is per device: CUDA tensors run the compiled kernel, CPU
#    tensors the interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so both are covered in one run;
#    tests/test_engine_cuda.py (skipped without CUDA) drives the engine on the GPU with a pinned HostSlab.
step "tests" "$RESULTS/gpu_check_tests.txt" timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=10 \
    tests/test_kernels_*.py tests/test_slab.py tests/test_engine.py tests/test_engine_warmup.py tests/test_engine_cuda.py

# 2. Benchmark. No TRITON_INTERPRET here: timings must come from compiled kernels.
if [[ "$DRY_RUN" == 1 ]]; then
    step "benchmark" "$RESULTS/gpu_check_bench.txt" env -u TRITON_INTERPRET timeout 120 "$PYTHON" -m bench.kernels \
        --quick --device cpu --name gpu_check_kernels_dry_run
else
    step "benchmark" "$RESULTS/gpu_check_bench.txt" env -u TRITON_INTERPRET timeout 120 "$PYTHON" -m bench.kernels \
        --device cuda --repeats 5 --name gpu_check_kernels
fi
# 3. dma against triton, both directions, over page sizes: the crossover sets AUTO_TABLE (kvtriton/worker/backends.py).
if [[ "$DRY_RUN" == 1 ]]; then
    step "crossover" "$RESULTS/gpu_check_crossover.txt" timeout 120 "$PYTHON" -m bench.crossover \
        --device cpu --page-kib 0.25 4 --layers 2 --blocks 32 --jobs 2 --name gpu_check_crossover_dry_run
else
    step "crossover" "$RESULTS/gpu_check_crossover.txt" env -u TRITON_INTERPRET timeout 120 "$PYTHON" -m bench.crossover \
        --device cuda --name gpu_check_crossover
fi

# 4. Host cost per job (copy replaced by a no-op), against the pre-redesign commit when git history is here.
BASELINE_FLAG=()
if ! git rev-parse --quiet --verify "$("$PYTHON" -c 'from bench.engine import BASELINE_COMMIT; print(BASELINE_COMMIT)')^{commit}" >/dev/null 2>&1; then
    BASELINE_FLAG=(--no-baseline)
fi
if [[ "$DRY_RUN" == 1 ]]; then
    step "host cost" "$RESULTS/gpu_check_engine.txt" timeout 60 "$PYTHON" -m bench.engine \
        --device cpu --quick ${BASELINE_FLAG[@]+"${BASELINE_FLAG[@]}"} --name gpu_check_engine_dry_run
else
    step "host cost" "$RESULTS/gpu_check_engine.txt" env -u TRITON_INTERPRET timeout 60 "$PYTHON" -m bench.engine \
        --device cuda --jobs 100 --repeats 5 ${BASELINE_FLAG[@]+"${BASELINE_FLAG[@]}"} --name gpu_check_engine
fi

step "ptx" "$RESULTS/gpu_check_ptx.txt" env -u TRITON_INTERPRET timeout 30 "$PYTHON" -m bench.kernels --ptx --name gpu_check_kernels

if (( ${#FAILED[@]} )); then
    echo "gpu_check: FAILED: ${FAILED[*]}; logs in $RESULTS" >&2
    exit 1
fi
echo "gpu_check: done; results in $RESULTS"
