#!/usr/bin/env bash
# The first GPU run: every GPU claim of kvtriton checked in under six minutes on an H100/H200.
#
#   bench/gpu_check.sh            on a CUDA machine with python3, torch, triton, pytest, hypothesis, numpy
#                                 (no vLLM, no network, no pip, no .venv needed: it installs nothing)
#   bench/gpu_check.sh --dry-run  the same steps on a CPU machine: each step's own code with CUDA skipped
#                                 and tiny sizes, writing the same files (make test runs it, so no typo can
#                                 waste a GPU run)
#
# Steps, each under its own budget (timeout -k), in this order; a step that fails or runs out of time
# never stops the next one, and a piece missing in the pre-flight skips only the steps that need it:
#
#   preflight   20 s  imports (pytest, hypothesis, kvtriton.kernels.jit.copy_pages), GPU, memlock, /dev/shm
#   cuda_tests 170 s  the CUDA tests alone, compiled kernels only (TRITON_INTERPRET=0), verbose
#   crossover   45 s  dma vs triton per direction around 28 KiB pages, each store finished before its load
#   kernels     60 s  triton vs dma vs one contiguous copy, 4 page sizes, both directions, and the fused
#                     fp8 kernels (triton-fp8) against plain triton in the same run
#   host_cost   40 s  host microseconds per job with the real kernel launch
#                     total 335 s, so a second run fits in a 15-minute GPU lease
#
# Everything goes to $OUT (default bench/results/gpu_check), written as each step goes, at most 8
# files, no folders: summary.json (one entry per step: name, status, seconds, budget, detail; rewritten
# after every step), preflight.txt, tests.log, steps.log, crossover.json, kernels.json, engine.json.
# The last thing printed is a one-screen summary; docs/benchmarks.md ("The first GPU run") says how to
# read it. Exit status 0 when every step ran and passed. PYTHON picks the interpreter (default:
# .venv/bin/python where it exists, else python3).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

DRY_RUN=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    -h | --help) sed -n '2,28p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument ${1}; use --dry-run or nothing" >&2; exit 2 ;;
esac
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT="${OUT:-bench/results/gpu_check}"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
export KVTRITON_BENCH_OUT="$OUT" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CI=1  # the reproducible hypothesis profile (tests/conftest.py)
export TRITON_INTERPRET=0  # compiled kernels only: the interpreter cases are CI's job
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
STEPS="$SCRATCH/steps.tsv"
: >"$STEPS"
rm -f "$OUT"/summary.json "$OUT"/preflight.txt "$OUT"/tests.log "$OUT"/steps.log \
    "$OUT"/crossover.json "$OUT"/kernels.json "$OUT"/engine.json
# Pinned slabs count against RLIMIT_MEMLOCK: take the hard limit (often unlimited) before anything pins.
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
    timeout -k 10 "$budget" "$@" 2>&1 | tee -a "$log"
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

# tests/test_gpu_check.py sources the script this far to drive the step runner through timeouts and failures.
[[ ${GPU_CHECK_FUNCTIONS_ONLY:-0} == 1 ]] && return 0

# --- preflight ----------------------------------------------------------------------------------------
PREFLIGHT_ENV="$SCRATCH/preflight.env"
run_step preflight 20 "$OUT/preflight.txt" "$PYTHON" - "$PREFLIGHT_ENV" "$DRY_RUN" "$(ulimit -l)" <<'PY'
import importlib, os, sys
env_path, dry_run, memlock = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
found = {}

def check(key, label, load):
    try:
        detail = load()
    except Exception as error:  # noqa: BLE001 -- a missing piece is reported, not raised
        found[key] = 0
        print(f"{label:18s} MISSING: {type(error).__name__}: {error}")
    else:
        found[key] = 1
        print(f"{label:18s} {detail}")

def version(module):
    return lambda: getattr(importlib.import_module(module), "__version__", "present")

print(f"{'python':18s} {sys.version.split()[0]}")
check("torch", "torch", version("torch"))
check("pytest", "pytest", version("pytest"))
check("hypothesis", "hypothesis", version("hypothesis"))
check("numpy", "numpy", version("numpy"))
check("triton", "triton", version("triton"))
check("kernels", "kernels (link)", lambda: importlib.import_module("kvtriton.kernels.jit.copy_pages").__file__)
cuda = 0
if found["torch"]:
    import torch
    cuda = int(torch.cuda.is_available())
    if cuda:
        index = torch.cuda.current_device()
        print(f"{'gpu':18s} {torch.cuda.get_device_name(index)} (CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s))")
        from kvtriton.worker.numa import _cuda_pci_bus_id, gpu_numa_node, node_count
        bus = _cuda_pci_bus_id(index)
        node = gpu_numa_node(bus) if bus else None
        print(f"{'numa':18s} {node_count()} node(s); GPU {bus} on node {node if node is not None else 'unknown'}")
    else:
        print(f"{'gpu':18s} none" + (" (dry run: CUDA steps run with CUDA skipped)" if dry_run else ""))
found["cuda"] = cuda
limit = "unlimited" if memlock == "unlimited" else f"{int(memlock) * 1024} bytes"
limit_bytes = None if memlock == "unlimited" else int(memlock) * 1024
found["memlock_tests_ok"] = int(limit_bytes is None or limit_bytes >= 16 << 20)  # the tests pin under 1 MiB at a time
found["memlock_ok"] = int(limit_bytes is None or limit_bytes >= 2 << 30)
verdict = "" if found["memlock_ok"] else ("  TOO LOW for the benchmarks' pinned slabs (up to ~1 GiB)" if found["memlock_tests_ok"] else "  TOO LOW to pin")
print(f"{'memlock (ulimit -l)':18s} {limit}{verdict}")
try:
    stats = os.statvfs("/dev/shm")
    shm = stats.f_bavail * stats.f_frsize
except OSError:
    shm = 0
found["shm_ok"] = int(shm >= 256 << 20)
print(f"{'/dev/shm free':18s} {shm} bytes" + ("" if found["shm_ok"] else "  TOO SMALL: the shared-region test is left out"))
with open(env_path, "w", encoding="ascii") as out:
    for key, value in found.items():
        out.write(f"PF_{key.upper()}={value}\n")
sys.exit(0 if found["torch"] else 1)
PY
PF_TORCH=0 PF_PYTEST=0 PF_HYPOTHESIS=0 PF_TRITON=0 PF_KERNELS=0 PF_CUDA=0 PF_MEMLOCK_TESTS_OK=0 PF_MEMLOCK_OK=0 PF_SHM_OK=0
# shellcheck disable=SC1090
[[ -f "$PREFLIGHT_ENV" ]] && source "$PREFLIGHT_ENV"

# What each step needs: a reason to skip it, or nothing.
gpu_missing=""
if [[ $PF_TORCH != 1 ]]; then gpu_missing="torch does not import"
elif [[ $PF_KERNELS != 1 ]]; then gpu_missing="kvtriton.kernels.jit.copy_pages does not import (triton missing, or the kvtriton/kernels link)"
elif [[ $DRY_RUN == 0 && $PF_CUDA != 1 ]]; then gpu_missing="no CUDA device (use --dry-run on a CPU machine)"
elif [[ $DRY_RUN == 0 && $PF_MEMLOCK_TESTS_OK != 1 ]]; then gpu_missing="RLIMIT_MEMLOCK too low to pin (ulimit -l unlimited; docker --ulimit memlock=-1)"
fi
bench_missing=$gpu_missing
if [[ -z $bench_missing && $DRY_RUN == 0 && $PF_MEMLOCK_OK != 1 ]]; then
    bench_missing="RLIMIT_MEMLOCK below the 2 GiB the benchmarks pin (ulimit -l unlimited; docker --ulimit memlock=-1)"
fi

# --- CUDA tests, first and alone -------------------------------------------------------------------------
# In this order: what only a GPU can prove first, the layout x dtype matrix of the kernels (most of the
# Triton compiles) last, so a run out of budget has already reported the rest.
TEST_FILES=(tests/test_engine_cuda.py)
[[ $PF_SHM_OK == 1 ]] && TEST_FILES+=(tests/test_tiering_cuda.py)
TEST_FILES+=(tests/test_kernels_large_offsets.py tests/test_slab.py tests/test_compression_engine.py tests/test_compression.py
    tests/test_kernels_gather.py tests/test_kernels_scatter.py)
if [[ -n $gpu_missing ]]; then skip cuda_tests 170 "$gpu_missing"
elif [[ $PF_PYTEST != 1 || $PF_HYPOTHESIS != 1 ]]; then skip cuda_tests 170 "pytest or hypothesis does not import"
else
    # -k: the CUDA cases of the kernel files (their CPU cases run the interpreter: CI's job) and all of the
    # slab tests (CPU fakes that must also hold where CUDA is present).
    run_step cuda_tests 170 "$OUT/tests.log" "$PYTHON" -m pytest -v -rfEs -p no:cacheprovider --durations=15 \
        -k "cuda or slab" "${TEST_FILES[@]}"
fi

# --- crossover: dma against triton, both directions, around vLLM's 28 KiB --------------------------------
if [[ -n $bench_missing ]]; then skip crossover 45 "$bench_missing"
elif [[ $DRY_RUN == 1 ]]; then
    run_step crossover 45 "$OUT/steps.log" "$PYTHON" -m bench.crossover --device cpu --page-kib 0.25 1 --layers 2 \
        --blocks 16 --jobs 1 --name crossover
else
    run_step crossover 45 "$OUT/steps.log" "$PYTHON" -m bench.crossover --device cuda --page-kib 8 16 32 64 \
        --layers 16 --blocks 128 --jobs 5 --name crossover
fi

# --- kernel benchmark, trimmed to what decides the goals ---------------------------------------------------
if [[ -n $bench_missing ]]; then skip kernels 60 "$bench_missing"
elif [[ $DRY_RUN == 1 ]]; then
    run_step kernels 60 "$OUT/steps.log" "$PYTHON" -m bench.kernels --gpu-check --device cpu --page-kib 4 16 \
        --blocks 8 --layers 2 --repeats 1 --no-plot --compression fp8-e4m3 --name kernels
else
    run_step kernels 60 "$OUT/steps.log" "$PYTHON" -m bench.kernels --gpu-check --device cuda --repeats 5 \
        --no-plot --compression fp8-e4m3 --name kernels
fi

# --- host cost per job with the real launch ------------------------------------------------------------------
if [[ -n $bench_missing ]]; then skip host_cost 40 "$bench_missing"
elif [[ $DRY_RUN == 1 ]]; then
    run_step host_cost 40 "$OUT/steps.log" "$PYTHON" -m bench.engine --device cpu --real-launch --page-tensors 2 \
        --blocks 1 4 --jobs 2 --repeats 1 --name engine
else
    run_step host_cost 40 "$OUT/steps.log" "$PYTHON" -m bench.engine --device cuda --real-launch --page-tensors 64 160 \
        --blocks 1 16 256 --jobs 100 --repeats 5 --name engine
fi

# --- one screen, last ------------------------------------------------------------------------------------------
"$PYTHON" - "$OUT" <<'PY'
import json, os, re, sys
out = sys.argv[1]

def load(name):
    try:
        with open(os.path.join(out, name), encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None

summary = load("summary.json") or {"steps": [], "dry_run": False}
print("=" * 100)
print(f"gpu_check summary{' (DRY RUN: CPU rehearsal, figures mean nothing)' if summary['dry_run'] else ''}   results in {out}")
try:
    for line in open(os.path.join(out, "preflight.txt"), encoding="utf-8"):
        if line.startswith(("gpu ", "numa ", "memlock", "torch ", "triton ")):
            print("  " + line.rstrip())
except OSError:
    pass
total = sum(step["seconds"] for step in summary["steps"])
budget = sum(step["budget"] for step in summary["steps"])
print(f"  {'step':11s} {'status':8s} {'seconds':>8s} {'budget':>7s}  detail")
for step in summary["steps"]:
    print(f"  {step['name']:11s} {step['status']:8s} {step['seconds']:8.1f} {step['budget']:7d}  {step['detail']}")
print(f"  {'total':11s} {'':8s} {total:8.1f} {budget:7d}")
try:
    text = open(os.path.join(out, "tests.log"), encoding="utf-8").read()
    counts = re.findall(r"^=+ (.*(?:passed|failed|error|skipped|deselected).*) in [0-9.]+s", text, re.M)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    print(f"  tests: {counts[-1] if counts else 'no pytest summary line (cut off? see tests.log)'}")
    for name in failed[:6]:
        print(f"    FAILED {name}")
except OSError:
    pass
crossover = load("crossover.json")
if crossover:
    crossings = crossover.get("crossover_page_bytes", {})
    rules = crossover.get("auto_table_min_page_bytes", {})
    state = "" if crossover.get("complete") else " (INCOMPLETE: cut off)"
    print(f"  crossover{state}: dma faster from (page bytes) {crossings or '-'}")
    for direction, size in rules.items():
        line = (f'AutoRule("cuda", True, TransferDirection.{direction.upper()}, {size}, TransferBackend.DMA)'
                if size is not None else "no dma row (triton wins somewhere)")
        print(f"    AUTO_TABLE {direction:5s}: {line}")
kernels = load("kernels.json")
if kernels:
    state = "" if kernels.get("complete") else " (INCOMPLETE: cut off)"
    blocks = sorted({r["blocks"] for r in kernels.get("results", [])})
    print(f"  kernels{state}: GB/s (x one contiguous copy), {'/'.join(map(str, blocks))} shuffled blocks")
    rows = {}
    for r in kernels.get("results", []):
        rows.setdefault((r["kernel"], r["page_bytes"]), {})[r["method"]] = r
    for (kernel, size), by in sorted(rows.items()):
        cells = "  ".join(f"{m} {by[m]['bandwidth_GBps']:7.2f} ({by[m]['vs_contiguous']:.2f})" for m in ("triton", "dma", "loop", "contiguous") if m in by)
        print(f"    {kernel:7s} {size // 1024:3d} KiB  {cells}")
engine = load("engine.json")
if engine:
    print("  host cost, real launch: us per job (goal)")
    for r in engine.get("results", []):
        goal = r.get("goal_us")
        verdict = "" if goal is None else ("  met" if r["current_us"] <= goal else "  MISSED")
        print(f"    {r['page_tensors']:3d} page tensors, {r['blocks']:3d} blocks: {r['current_us']:8.1f} ({goal if goal is not None else '-'}){verdict}")
bad = [step["name"] for step in summary["steps"] if step["status"] not in ("ok", "skipped")]
skipped = [step["name"] for step in summary["steps"] if step["status"] == "skipped"]
# A GPU run that skipped a step proved less than it should: that is a failure too (a dry run skips nothing).
incomplete = bool(skipped) and not summary["dry_run"]
verdict = "FAILED: " + ", ".join(bad) if bad else ("INCOMPLETE" if incomplete else "every step that ran passed")
print(f"  verdict: {verdict}" + (f"; skipped: {', '.join(skipped)} (see each step's reason above)" if skipped else ""))
print("=" * 100)
sys.exit(1 if bad or incomplete else 0)
PY
