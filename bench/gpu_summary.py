"""The one-screen summary ``bench/gpu_check.sh`` prints last, from the files it wrote into ``$OUT``.

``python -m bench.gpu_summary OUT`` reads ``summary.json`` (the steps),
``preflight.txt``, ``tests.log``, ``crossover.json``, ``kernels.json`` and
``host_cost.json``, any of which may be missing or cut short, and prints at most
40 lines: the GPU, its pins and its launch from the pre-flight, one row per step, the test
counts of each pytest run (counted from its verbose lines when the run was
cut off before its summary line), the crossover verdict with the
``AUTO_TABLE`` rows, the kernel ratios (Triton at 16 and 32 programs, the
``dma`` backend with its batch call and held to one 2-D copy per run, the
per-block loop) with the fp8 kernels against plain Triton at each program
count, the methods that failed (one line), the compiled variants' registers
and spills, the host cost against its goals with the batch call's array
building beside it, and the verdict. Exit status 0 only when
every step ran and passed (a dry run may skip nothing either, and never has
to). Standard library only: it must run where torch does not import.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

__all__ = ["JSON", "kernel_lines", "main", "pytest_runs", "summary_lines"]

JSON = dict[str, object]
PREFLIGHT_LABELS = ("gpu ", "triton launch", "pin ")
"""The pre-flight lines the screen shows as they are (memlock, information only, and the rest stay in preflight.txt)."""
LABEL_WIDTH = 21
"""Characters of a pre-flight line before its text: the label, padded to 20, and a space."""
VERSION_LABELS = ("torch", "triton")
"""The pre-flight's version lines, shown together on one line."""
MAX_FAILED_SHOWN = 3
_STEP_START = re.compile(r"^== (\S+) \(budget \d+ s\)$", re.M)
_PYTEST_TOTALS = re.compile(r"^=+ (.*(?:passed|failed|error|skipped|deselected).*) in [0-9.]+s", re.M)
_VERBOSE_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)
_SHORT_FAILURE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


def _load(out: Path, name: str) -> JSON | None:
    try:
        loaded: object = json.loads((out / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return cast(JSON, loaded) if isinstance(loaded, dict) else None


def _rows(record: JSON, key: str) -> list[JSON]:
    value = record.get(key)
    if not isinstance(value, list):
        return []
    return [cast(JSON, row) for row in cast(list[object], value) if isinstance(row, dict)]


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _kib(size: object) -> str:
    number = _float(size)
    return "-" if number is None else f"{number / 1024:g} KiB"


def pytest_runs(log: str) -> list[tuple[str, str, list[str]]]:
    """Per pytest run in ``tests.log`` (one per step section): the step, its counts, the tests that failed.

    The counts are pytest's own summary line; a run cut off before it (a
    timeout) is counted from its verbose ``PASSED``/``FAILED`` lines instead,
    marked ``cut off``.
    """
    starts = list(_STEP_START.finditer(log))
    runs: list[tuple[str, str, list[str]]] = []
    for index, start in enumerate(starts):
        section = log[start.end() : starts[index + 1].start() if index + 1 < len(starts) else len(log)]
        totals = _PYTEST_TOTALS.findall(section)
        outcomes = _VERBOSE_OUTCOME.findall(section)
        verbose_failed = [name for name, outcome in outcomes if outcome in ("FAILED", "ERROR")]
        failed = _SHORT_FAILURE.findall(section) if totals else verbose_failed
        if totals:
            counts = str(totals[-1])
        elif outcomes:
            tally: dict[str, int] = {}
            for _, outcome in outcomes:
                tally[outcome.lower()] = tally.get(outcome.lower(), 0) + 1
            counts = "cut off after " + ", ".join(f"{count} {outcome}" for outcome, count in tally.items())
        else:
            counts = "no test finished (see tests.log)"
        runs.append((start.group(1), counts, failed))
    return runs


def _ratio(row: JSON | None) -> str:
    value = None if row is None else _float(row.get("vs_contiguous"))
    return "-" if value is None else f"{value:.2f}"


def kernel_lines(kernels: JSON) -> list[str]:
    """Per page size (in run order: the headline first) and kernel: triton at 16 and 32 programs, dma, dma-2d and
    loop x contiguous, fp8 x plain; then the methods that failed, and the compiled variants."""
    results = _rows(kernels, "results")
    rows: dict[tuple[object, object], dict[str, JSON]] = {}
    for row in results:
        rows.setdefault((row.get("page_bytes"), row.get("kernel")), {})[str(row.get("method"))] = row
    fp8: dict[tuple[object, object], dict[int, float]] = {}
    for ratio in _rows(kernels, "fp8_vs_plain"):
        programs, value = ratio.get("programs"), _float(ratio.get("ratio"))
        if isinstance(programs, int) and value is not None:
            fp8.setdefault((ratio.get("page_bytes"), ratio.get("kernel")), {})[programs] = value
    counts = sorted({programs for by in fp8.values() for programs in by})
    state = "" if kernels.get("complete") else " (INCOMPLETE: cut off)"
    block_counts = sorted({count for count in (row.get("blocks") for row in results) if isinstance(count, int)})
    blocks = "/".join(str(count) for count in block_counts)
    lines = [
        f"  kernels{state}: x contiguous copy (triton GB/s), {blocks or '-'} blocks; "
        "fp8@N = triton-fp8, N programs, x triton",
        f"    {'page':8s} {'kernel':8s} {'triton':>13s} {'t@32':>6s} {'dma':>6s} {'dma-2d':>6s} {'loop':>6s}"
        + "".join(f"{f'fp8@{count}':>8s}" for count in counts),
    ]
    for (size, kernel), by in rows.items():
        triton = by.get("triton")
        speed = None if triton is None else _float(triton.get("bandwidth_GBps"))
        triton_text = _ratio(triton) + (f" ({speed:.1f})" if speed is not None else "")
        ratios = fp8.get((size, kernel), {})
        fp8_text = "".join(f"{ratios[count]:8.2f}" if count in ratios else f"{'-':>8s}" for count in counts)
        lines.append(
            f"    {_kib(size):8s} {str(kernel):8s} {triton_text:>13s} {_ratio(by.get('triton-p32')):>6s} "
            f"{_ratio(by.get('dma')):>6s} {_ratio(by.get('dma-2d')):>6s} {_ratio(by.get('loop')):>6s}{fp8_text}"
        )
    errors = _rows(kernels, "errors")
    if errors:
        first = errors[0]
        lines.append(
            f"    {len(errors)} method run(s) FAILED (errors in kernels.json), the first: {first.get('method')} "
            f"{first.get('kernel')} {_kib(first.get('page_bytes'))}: {str(first.get('error'))[:60]}"
        )
    variants = _rows(kernels, "compiled_variants")
    if variants:
        regs = sorted(count for count in (v.get("n_regs") for v in variants) if isinstance(count, int))
        spilling = [count for count in (v.get("n_spills") for v in variants) if isinstance(count, int) and count > 0]
        spill_text = f"SPILLS in {len(spilling)}" if spilling else "no spills"
        reg_text = f"regs {regs[0]}-{regs[-1]}" if regs else "regs -"
        lines.append(
            f"    {len(variants)} compiled variants: {reg_text}, {spill_text} (compiled_variants in kernels.json)"
        )
    return lines


def _crossover_lines(crossover: JSON) -> list[str]:
    found = crossover.get("crossover_page_bytes")
    crossings = cast(dict[str, object], found) if isinstance(found, dict) else {}
    text = ", ".join(f"{key} {_kib(size) if size is not None else 'never'}" for key, size in crossings.items())
    sizes = [size for size in cast(list[object], crossover.get("verdict_page_bytes") or []) if isinstance(size, int)]
    swept = f"; verdict from {_kib(min(sizes))}-{_kib(max(sizes))} pages" if sizes else ""
    state = "" if crossover.get("complete") else f" (INCOMPLETE: cut off{swept})"
    lines = [f"  crossover{state}: dma faster from {text or '-'}"]
    rows = crossover.get("auto_table_rows")
    if isinstance(rows, dict):
        for direction, line in cast(dict[str, object], rows).items():
            lines.append(f"    AUTO_TABLE {direction:5s}: {line}")
    return lines


def _host_cost_lines(engine: JSON) -> list[str]:
    state = "" if engine.get("complete", True) else " (INCOMPLETE: cut off)"
    lines = [f"  host cost{state}, real launch: us per job by blocks (goal)"]
    by_tensors: dict[object, list[JSON]] = {}
    for row in _rows(engine, "results"):
        by_tensors.setdefault(row.get("page_tensors"), []).append(row)
    arrays: dict[object, list[JSON]] = {}
    for row in _rows(engine, "batch_arrays"):
        arrays.setdefault(row.get("page_tensors"), []).append(row)
    for tensors, rows in by_tensors.items():
        cells = ", ".join(f"{row.get('blocks')} blk {_float(row.get('current_us')) or 0:.1f}" for row in rows)
        goal = _float(rows[0].get("goal_us"))
        missed = goal is not None and any((_float(row.get("current_us")) or 0) > goal for row in rows)
        verdict = "" if goal is None else ("  MISSED" if missed else "  met")
        batch = "/".join(f"{_float(row.get('arrays_us')) or 0:.1f}" for row in arrays.get(tensors, []))
        batch_text = f"; batch arrays {batch}" if batch else ""
        lines.append(f"    {tensors} page tensors: {cells} ({goal if goal is not None else '-'}){verdict}{batch_text}")
    return lines


def summary_lines(out: Path) -> tuple[list[str], int]:
    """The summary screen for the results in ``out`` and the exit status it stands for."""
    summary = _load(out, "summary.json") or {"steps": [], "dry_run": False}
    steps = _rows(summary, "steps")
    dry_run = bool(summary.get("dry_run"))
    rehearsal = " (DRY RUN: CPU rehearsal, figures mean nothing)" if dry_run else ""
    lines = ["=" * 100, f"gpu_check summary{rehearsal}   results in {out}"]
    try:
        preflight = (out / "preflight.txt").read_text(encoding="utf-8").splitlines()
    except OSError:
        preflight = []
    # A pre-flight line is its label padded to LABEL_WIDTH, then its text (bench/gpu_preflight.py).
    versions = [
        f"{line[:LABEL_WIDTH].strip()} {line[LABEL_WIDTH:].strip()}"
        for line in preflight
        if line[:LABEL_WIDTH].strip() in VERSION_LABELS
    ]
    if versions:
        lines.append("  " + ", ".join(versions))
    lines += ["  " + line.rstrip() for line in preflight if line.startswith(PREFLIGHT_LABELS)]
    total = sum(_float(step.get("seconds")) or 0 for step in steps)
    budget = sum(_float(step.get("budget")) or 0 for step in steps)
    lines.append(
        f"  {'step':11s} {'status':8s} {'seconds':>8s} {'budget':>7s}  detail   (total {total:.1f} s of {budget:.0f})"
    )
    for step in steps:
        lines.append(
            f"  {str(step.get('name')):11s} {str(step.get('status')):8s} {_float(step.get('seconds')) or 0:8.1f} "
            f"{_float(step.get('budget')) or 0:7.0f}  {step.get('detail', '')}"
        )
    try:
        runs = pytest_runs((out / "tests.log").read_text(encoding="utf-8"))
    except OSError:
        runs = []
    failed = [name for _, _, names in runs for name in names]
    for step, counts, _ in runs:
        lines.append(f"  tests ({step}): {counts}")
    for name in failed[:MAX_FAILED_SHOWN]:
        lines.append(f"    FAILED {name}")
    if len(failed) > MAX_FAILED_SHOWN:
        lines[-1] += f"   (+{len(failed) - MAX_FAILED_SHOWN} more in tests.log)"
    renderers = (
        ("crossover.json", _crossover_lines),
        ("kernels.json", kernel_lines),
        ("host_cost.json", _host_cost_lines),
    )
    for name, render in renderers:
        record = _load(out, name)
        if record is not None:
            lines += render(record)
    bad = [str(step.get("name")) for step in steps if step.get("status") not in ("ok", "skipped")]
    skipped = [str(step.get("name")) for step in steps if step.get("status") == "skipped"]
    # A GPU run that skipped a step proved less than it should: that is a failure too.
    incomplete = bool(skipped) and not dry_run
    verdict = "FAILED: " + ", ".join(bad) if bad else ("INCOMPLETE" if incomplete else "every step that ran passed")
    reasons = f"; skipped: {', '.join(skipped)} (see each step's reason above)" if skipped else ""
    lines.append(f"  verdict: {verdict}{reasons}")
    lines.append("=" * 100)
    return lines, 1 if bad or incomplete else 0


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if len(arguments) != 1:
        print("usage: python -m bench.gpu_summary OUT", file=sys.stderr)
        return 2
    lines, status = summary_lines(Path(arguments[0]))
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
