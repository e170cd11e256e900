#!/usr/bin/env bash
# The first GPU run: every GPU claim of kvtriton checked in at most five minutes on an H100/H200.
#
#   bench/gpu_check.sh            on a CUDA machine with python3, torch, triton, pytest, hypothesis, numpy
#                                 (no vLLM, no xxhash, no network, no pip, no .venv needed: it installs nothing)
#   bench/gpu_check.sh --dry-run  the same steps on a CPU machine: each step's own code with CUDA skipped
#                                 and tiny sizes, writing the same files, under an import blocker that leaves
#                                 only the GPU machine's packages importable (bench/gpu_machine_imports.py),
#                                 so an import that machine lacks fails here first (make test runs it, so no
#                                 typo and no missing package can waste a GPU run)
#
# Steps, each under its own budget (timeout -k; the BUDGET_* lines below), in this order; a step that fails
# or runs out of time never stops the next one, only a piece the pre-flight found missing skips a step, a
# test file that fails to collect loses its own cases only, and a benchmark method that fails loses its row:
#
#   preflight   35 s  imports (a failed one named), GPU, /dev/shm, memlock (information only), a real pin of
#                     64 MiB and of 1 GiB (their GB/s: the slab's start-up cost), one rank's view of a shared
#                     region with 1 GiB of its own (seconds per GiB, registrations), one tiny compiled launch
#   cuda_tests  95 s  the CUDA tests alone, compiled kernels only (TRITON_INTERPRET=0), verbose
#   fp8_tests   50 s  the fp8 kernels' CUDA tests in a pytest process of their own: a sticky CUDA fault
#                     there (one kills the context) cannot lose the other CUDA cases
#   crossover   25 s  dma vs triton per direction around 28 KiB pages, each store finished before its load
#   kernels     60 s  triton at 16 and 32 programs (prepared launchers) vs dma (its batch call) vs dma-2d (one
#                     2-D copy per run) vs one contiguous copy, 32 KiB first, then 4, 16 and 64 KiB, both
#                     directions, each on a stream of its own, and the fused fp8 kernels (triton-fp8) against
#                     plain triton, the gather at 16, 32 and 64 programs; registers and spills of each variant
#   host_cost   35 s  host microseconds per job with the real kernel launch, and the dma batch call's arrays
#                     total 300 s of BUDGET_TOTAL=300 (a reviewer's per-step estimates for an H100 host, each
#                     rounded up): start-up takes 2-4 minutes of a 15-minute lease, so a run, a fix and a
#                     second run fit in one. Estimated from an empty Triton cache: fp8 28-40 s (24 variants
#                     compiled), kernels at most 45 s, the pre-flight's pins up to 25 s on a cold disk
#
# Everything goes to $OUT (default bench/results/gpu_check), written as each step goes, at most 8
# files, no folders: summary.json (one entry per step: name, status, seconds, budget, detail; rewritten
# after every step), preflight.txt, tests.log, steps.log, crossover.json, kernels.json, host_cost.json.
# Each benchmark rewrites its JSON after every case, so a step cut off at its budget keeps its figures.
# The last thing printed is a one-screen summary (bench/gpu_summary.py); docs/benchmarks.md ("The first
# GPU run") says how to read it. Exit status 0 when every step ran and passed. PYTHON picks the
# interpreter (default: .venv/bin/python where it exists, else python3).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

DRY_RUN=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    -h | --help) sed -n '2,39p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument ${1}; use --dry-run or nothing" >&2; exit 2 ;;
esac
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

# Each step's time limit in seconds, and their total: two runs and the machine's start-up must fit in a
# 15-minute lease. A step past its limit gets SIGTERM, then SIGKILL KILL_AFTER seconds later.
BUDGET_PREFLIGHT=35
BUDGET_CUDA_TESTS=95
BUDGET_FP8_TESTS=50
BUDGET_CROSSOVER=25
BUDGET_KERNELS=60
BUDGET_HOST_COST=35
BUDGET_TOTAL=300
KILL_AFTER=5
budget_sum=$((BUDGET_PREFLIGHT + BUDGET_CUDA_TESTS + BUDGET_FP8_TESTS + BUDGET_CROSSOVER + BUDGET_KERNELS
    + BUDGET_HOST_COST))
if ((budget_sum > BUDGET_TOTAL)); then
    echo "gpu_check: the step budgets add up to ${budget_sum} s, over BUDGET_TOTAL=${BUDGET_TOTAL} s" >&2
    exit 2
fi

OUT="${OUT:-bench/results/gpu_check}"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
export KVTRITON_BENCH_OUT="$OUT" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CI=1  # the reproducible hypothesis profile (tests/conftest.py)
export TRITON_INTERPRET=0  # compiled kernels only: the interpreter cases are CI's job
if [[ $DRY_RUN == 1 ]]; then
    # Every Python process of the rehearsal sees only the GPU machine's packages (its sitecustomize.py).
    export PYTHONPATH="$PWD/bench/gpu_machine:$PYTHONPATH"
fi
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
STEPS="$SCRATCH/steps.tsv"
: >"$STEPS"
rm -f "$OUT"/summary.json "$OUT"/preflight.txt "$OUT"/tests.log "$OUT"/steps.log \
    "$OUT"/crossover.json "$OUT"/kernels.json "$OUT"/host_cost.json
# The hard memlock limit, where it is higher (harmless; cudaHostRegister is not charged to it anyway).
ulimit -S -l "$(ulimit -H -l)" 2>/dev/null

write_summary() {  # summary.json from the steps so far (rewritten after each step: a cut-off run keeps it)
    "$PYTHON" - "$STEPS" "$OUT/summary.json" "$DRY_RUN" <<'PY'
import json, sys
steps_path, summary_path, dry_run = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
steps = []
for line in open(steps_path, encoding="utf-8"):
    name, status, seconds, budget, detail = line.rstrip("\n").split("\t")
    steps.append({"name": name, "status": status, "seconds": float(seconds), "budget": int(budget), "detail": detail})
with open(summary_path, "w", encoding="utf-8") as out:
    json.dump({"dry_run": dry_run, "steps": steps}, out, indent=2)
    out.write("\n")
PY
}

record() {  # record NAME STATUS SECONDS BUDGET DETAIL
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$STEPS"
    write_summary
}

skip() {  # skip NAME BUDGET REASON
    echo "== $1: skipped ($3)" | tee -a "$OUT/steps.log"
    record "$1" skipped 0 "$2" "$3"
}

run_step() {  # run_step NAME BUDGET LOG COMMAND...: timed, under its budget, output teed to LOG
    local name=$1 budget=$2 log=$3 started status seconds result
    shift 3
    echo "== $name (budget ${budget} s)" | tee -a "$log"
    started=$(date +%s.%N)
    timeout -k "${KILL_AFTER:-5}" "$budget" "$@" 2>&1 | tee -a "$log"
    status=${PIPESTATUS[0]}
    seconds=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    case $status in
        0) result=ok ;;
        124 | 137) result=timeout ;;
        *) result=failed ;;
    esac
    echo "== $name: $result after $seconds s (exit $status)" | tee -a "$log"
    record "$name" "$result" "$seconds" "$budget" "exit $status"
}

read_preflight() {  # read_preflight ENV_FILE: the PF_<KEY>=0|1 lines the pre-flight wrote; any other line is ignored
    local key value
    [[ -f $1 ]] || return 0
    while IFS='=' read -r key value; do
        if [[ $key =~ ^PF_[A-Z0-9_]+$ && $value =~ ^[01]$ ]]; then printf -v "$key" '%s' "$value"; fi
    done <"$1"
}

missing() {  # missing KEY: true only when the pre-flight wrote PF_KEY=0 (a key it never wrote, cut off, is tried)
    local name="PF_$1"
    [[ ${!name:-} == 0 ]]
}

decide_skips() {  # sets gpu_missing, bench_missing, tests_missing: why a step is skipped, or nothing
    gpu_missing="" bench_missing="" tests_missing=""
    if missing TORCH; then gpu_missing="torch does not import"
    elif missing KERNELS; then
        gpu_missing="kvtriton.kernels._jit.copy_pages does not import (triton missing, or the kvtriton/kernels link)"
    elif [[ $DRY_RUN == 0 ]] && missing CUDA; then gpu_missing="no CUDA device (use --dry-run on a CPU machine)"
    elif [[ $DRY_RUN == 0 ]] && missing PIN_SMALL; then
        gpu_missing="pinning a 64 MiB slab failed (preflight.txt says why)"
    fi
    bench_missing=$gpu_missing
    if [[ -z $bench_missing && $DRY_RUN == 0 ]] && missing PIN_LARGE; then
        bench_missing="pinning a 1 GiB slab failed, and the benchmarks pin up to ~1 GiB (preflight.txt says why)"
    fi
    tests_missing=$gpu_missing
    if [[ -z $tests_missing ]] && { missing PYTEST || missing HYPOTHESIS; }; then
        tests_missing="pytest or hypothesis does not import"
    fi
}

# tests/bench/test_gpu_check.py sources the script this far to drive the step runner and the skip decisions.
[[ ${GPU_CHECK_FUNCTIONS_ONLY:-0} == 1 ]] && return 0

# --- preflight ----------------------------------------------------------------------------------------
# Its findings go to preflight.env line by line: a pre-flight cut off at its budget keeps what it found,
# and whatever it did not get to is tried rather than skipped.
PREFLIGHT_ENV="$SCRATCH/preflight.env"
PREFLIGHT_ARGS=("$PREFLIGHT_ENV")
[[ $DRY_RUN == 1 ]] && PREFLIGHT_ARGS+=(--dry-run)
run_step preflight "$BUDGET_PREFLIGHT" "$OUT/preflight.txt" "$PYTHON" -m bench.gpu_preflight "${PREFLIGHT_ARGS[@]}"
read_preflight "$PREFLIGHT_ENV"
decide_skips

# --- CUDA tests, first and alone -------------------------------------------------------------------------
# In this order: what only a GPU can prove first, the layout x dtype matrix of the kernels (most of the
# Triton compiles) last, so a run out of budget has already reported the rest. -k: the CUDA cases of the
# kernel files (their CPU cases run the interpreter: CI's job) and all of the slab tests (CPU fakes that
# must also hold where CUDA is present). --tb=short keeps tests.log small. A file that fails to collect
# loses its own cases, not the session's (--continue-on-collection-errors). Plugins: hypothesis's only, as
# on the GPU machine, whatever else this machine has installed.
PYTEST=(env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PYTHON" -m pytest -p _hypothesis_pytestplugin -v -rfEs --tb=short
    -p no:cacheprovider --continue-on-collection-errors --durations=10 -k "cuda or slab")
TEST_FILES=(tests/worker/test_engine_cuda.py)
missing SHM_OK || TEST_FILES+=(tests/integrations/vllm/test_tiering_cuda.py)
TEST_FILES+=(tests/kernels/test_kernels_large_offsets.py tests/worker/test_slab.py tests/worker/test_compression_engine.py
    tests/kernels/test_kernels_gather.py tests/kernels/test_kernels_scatter.py)
if [[ -n $tests_missing ]]; then skip cuda_tests "$BUDGET_CUDA_TESTS" "$tests_missing"
else run_step cuda_tests "$BUDGET_CUDA_TESTS" "$OUT/tests.log" "${PYTEST[@]}" "${TEST_FILES[@]}"
fi
# The fused fp8 kernels' cases in a process of their own: a sticky CUDA error there (a misaligned
# address kills the context) would otherwise fail every CUDA case after it.
if [[ -n $tests_missing ]]; then skip fp8_tests "$BUDGET_FP8_TESTS" "$tests_missing"
else run_step fp8_tests "$BUDGET_FP8_TESTS" "$OUT/tests.log" "${PYTEST[@]}" tests/kernels/test_compression.py
fi

# --- crossover: dma against triton, both directions, around vLLM's 28 KiB --------------------------------
if [[ -n $bench_missing ]]; then skip crossover "$BUDGET_CROSSOVER" "$bench_missing"
elif [[ $DRY_RUN == 1 ]]; then
    run_step crossover "$BUDGET_CROSSOVER" "$OUT/steps.log" "$PYTHON" -m bench.crossover --device cpu \
        --page-kib 0.25 1 --layers 2 --blocks 16 --jobs 1 --name crossover
else
    run_step crossover "$BUDGET_CROSSOVER" "$OUT/steps.log" "$PYTHON" -m bench.crossover --device cuda \
        --page-kib 8 16 32 64 --layers 16 --blocks 128 --jobs 5 --name crossover
fi

# --- kernel benchmark, trimmed to what decides the goals: the 32 KiB headline size first ------------------
if [[ -n $bench_missing ]]; then skip kernels "$BUDGET_KERNELS" "$bench_missing"
elif [[ $DRY_RUN == 1 ]]; then
    run_step kernels "$BUDGET_KERNELS" "$OUT/steps.log" "$PYTHON" -m bench.kernels --gpu-check --device cpu \
        --page-kib 4 32 --blocks 8 --layers 2 --repeats 1 --no-plot --compression fp8-e4m3 --name kernels
else
    run_step kernels "$BUDGET_KERNELS" "$OUT/steps.log" "$PYTHON" -m bench.kernels --gpu-check --device cuda \
        --repeats 5 --no-plot --compression fp8-e4m3 --fp8-programs 16 32 64 --name kernels
fi

# --- host cost per job with the real launch (its slabs are small: no 1 GiB pin needed) -------------------------
if [[ -n $gpu_missing ]]; then skip host_cost "$BUDGET_HOST_COST" "$gpu_missing"
elif [[ $DRY_RUN == 1 ]]; then
    run_step host_cost "$BUDGET_HOST_COST" "$OUT/steps.log" "$PYTHON" -m bench.host_cost --device cpu --real-launch \
        --page-tensors 2 --blocks 1 4 --jobs 2 --repeats 1 --name host_cost
else
    run_step host_cost "$BUDGET_HOST_COST" "$OUT/steps.log" "$PYTHON" -m bench.host_cost --device cuda --real-launch \
        --page-tensors 64 160 --blocks 1 16 256 --jobs 100 --repeats 5 --name host_cost
fi

# --- one screen, last ------------------------------------------------------------------------------------------
"$PYTHON" -m bench.gpu_summary "$OUT"
