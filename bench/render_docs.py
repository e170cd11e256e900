"""Write every benchmark figure in README.md and docs/ from bench/results/*.json: one source for each number.

The supported vLLM releases are rendered the same way, from
``TESTED_VLLM_RELEASES`` (kvtriton/integrations/_vllm_release.py) and the
releases the Makefile's test environments install (``vllm-releases``,
``vllm-requirement``, ``vllm-releases-table``, ...), so that no page can name
another range than the one the code enforces.

A figure in the docs sits between two markers, named after what renders it::

    <!-- generated:manager-headline-range -->ARC 2.54x to 2.80x<!-- /generated:manager-headline-range -->

A region whose text starts on a new line after its opening marker is a
block (a table), else it is inline (a phrase inside a sentence). ``python -m
bench.render_docs`` rewrites every region from the result files;
``--check`` changes nothing and exits 1 naming each stale region, which is
what ``make test`` runs (``tests/project/test_docs_figures.py``): after a benchmark
rewrote its JSON, run this and commit both. Prose around the markers is the
docs' own; only what the JSON says is generated, so no two places can
disagree on a number.

Units, everywhere: bandwidth in GB/s (10^9 bytes per second), hit rates in
percent, speed-ups as ``2.54x``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import cast

from bench.common import bench_parser
from bench.manager import HEADLINE_COLUMNS
from bench.render_results import REPO, RESULTS, JSONObject, RenderError, Results
from bench.render_serving import SERVING_RENDERERS, serving_goal_row
from bench.render_simulate import SIMULATE_RENDERERS
from kvtriton.integrations import (
    ALLOW_UNTESTED_VLLM,
    TESTED_VLLM_RANGE,
    TESTED_VLLM_RELEASES,
    tested_releases,
    vllm_release,
)

__all__ = ["MANAGER_SPEEDUP_GOAL", "RENDERERS", "RenderError", "Results", "render_text", "main", "stale_regions"]


MANAGER_SPEEDUP_GOAL = 2.5
"""kvtriton through its vLLM adapter, in vLLM's call order, against vLLM 0.33's manager: blocks/s, each
workload and policy. It supersedes the first goal (2x, kvtriton's direct calls), now a second table."""
KERNEL_FALLBACK_GOAL = 0.7
"""The CPU fallback's gather and scatter, as a fraction of one contiguous copy of the same bytes."""

MARKER = re.compile(r"<!-- generated:(?P<name>[\w-]+) -->(?P<body>.*?)<!-- /generated:(?P=name) -->", re.DOTALL)


def _obj(value: object) -> JSONObject:
    if not isinstance(value, dict):
        raise RenderError(f"expected a JSON object, got {value!r:.60}")
    return cast(JSONObject, value)


def _list(value: object) -> list[JSONObject]:
    if not isinstance(value, list):
        raise RenderError(f"expected a JSON list, got {value!r:.60}")
    return [_obj(item) for item in cast(list[object], value)]


def _num(record: Mapping[str, object], key: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RenderError(f"expected a number at {key!r}, got {value!r:.60}")
    return float(value)


_BANDWIDTH_KEYS = ("gb_per_s", "bandwidth_gb_per_s", "gbytes_per_s", "gbps")
"""Names a row's GB/s (10^9 bytes per second) may have, newest first; ``gbps`` is the old one."""


def gb_per_s(row: Mapping[str, object]) -> float:
    """A row's bandwidth in GB/s, whichever of :data:`_BANDWIDTH_KEYS` it is stored under."""
    for key in _BANDWIDTH_KEYS:
        if key in row:
            return _num(row, key)
    raise RenderError(f"no bandwidth field ({', '.join(_BANDWIDTH_KEYS)}) in {dict(row)!r:.80}")


def run_date(record: JSONObject) -> str:
    """``2026-12-01 01:23 UTC`` from the machine record of a result file."""
    date = str(_obj(record.get("machine")).get("date", ""))
    match = re.match(r"(\d{4}-\d\d-\d\d)T(\d\d:\d\d)", date)
    if match is None:
        raise RenderError(f"no machine.date in the result file, got {date!r}")
    return f"{match.group(1)} {match.group(2)} UTC"


def run_machine(record: JSONObject) -> str:
    machine = _obj(record.get("machine"))
    device = str(machine.get("device_name", "?"))
    return "CPU only" if device in ("cpu", "cpu-interpreter") else device


def _x(ratio: float) -> str:
    return f"{ratio:.2f}x"


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.2f}%"


def _count(value: float) -> str:
    return f"{value:,.0f}"


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> str:
    """A Markdown table; ``align`` has one letter per column: ``l`` left, ``r`` right."""
    rule = ["---:" if letter == "r" else "---" for letter in align]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# -- the scheduler-side manager (bench/manager.py) ---------------------------------------------------------


def _headline_rows(results: Results, name: str = "manager") -> list[JSONObject]:
    return _list(_obj(results(name).get("headline")).get("rows"))


def _range(values: Sequence[float]) -> str:
    low, high = min(values), max(values)
    return _x(low) if f"{low:.2f}" == f"{high:.2f}" else f"{_x(low)} to {_x(high)}"


def _speedups(results: Results, policy: str, name: str = "manager") -> list[float]:
    return [_num(row, "speedup") for row in _headline_rows(results, name) if row.get("policy") == policy]


def _median_range(timing: JSONObject) -> str:
    """``12,345 (11,000-13,000)``: a timing's median blocks/s and its range."""
    return f"{_count(_num(timing, 'median'))} ({_count(_num(timing, 'low'))}-{_count(_num(timing, 'high'))})"


def manager_headline_table(results: Results) -> str:
    rows: list[list[str]] = []
    for row in _headline_rows(results):
        theirs, ours = _obj(row.get("vllm")), _obj(row.get("kvtriton_via_vllm_adapter"))
        rows.append(
            [
                str(row.get("workload")),
                str(row.get("policy")).upper(),
                _count(_num(row, "capacity")),
                _median_range(theirs),
                _median_range(ours),
                _x(_num(row, "speedup")),
                f"{_pct(_num(theirs, 'hit_rate'))} / {_pct(_num(ours, 'hit_rate'))}",
            ]
        )
    return _table([*HEADLINE_COLUMNS, "hit rate (vLLM / kvtriton)"], rows, "llrrrrl")


def manager_headline_range(results: Results, name: str = "manager") -> str:
    """The range of the headline speed-ups of each policy in result file ``name``."""
    return f"ARC {_range(_speedups(results, 'arc', name))}, LRU {_range(_speedups(results, 'lru', name))}"


def manager_before_range(results: Results) -> str:
    """The headline of the same command before commit fa74cda's changes, with LRU's hit-rate gap to vLLM's."""
    name = "manager_before_fa74cda"
    gaps = [100 * _hit_rate_gap(row) for row in _headline_rows(results, name) if row.get("policy") == "lru"]
    return f"{manager_headline_range(results, name)}, LRU's hit rate {min(gaps):.1f} to {max(gaps):.1f} points below vLLM's"


def _workload_policy(row: JSONObject) -> str:
    return f"{row.get('workload')} {str(row.get('policy')).upper()}"


def _hit_rate_gap(row: JSONObject) -> float:
    """vLLM's hit rate less kvtriton's (through the adapter) on a headline row, as fractions."""
    return _num(_obj(row.get("vllm")), "hit_rate") - _num(_obj(row.get("kvtriton_via_vllm_adapter")), "hit_rate")


def manager_headline_verdict(results: Results) -> str:
    rows = _headline_rows(results)
    short = [_workload_policy(row) for row in rows if _num(row, "speedup") < MANAGER_SPEEDUP_GOAL]
    lower = [_workload_policy(row) for row in rows if _hit_rate_gap(row) > 0]
    speed = "met on every workload for both policies" if not short else f"NOT met for {', '.join(short)}"
    hits = "hit rates equal or higher on every row" if not lower else f"hit rate below vLLM's for {', '.join(lower)}"
    return f"Goal {MANAGER_SPEEDUP_GOAL:g}x: {speed}; {hits}"


def _direct_table(record: JSONObject) -> str:
    rows: list[list[str]] = []
    for row in _list(record.get("results")):
        ours, theirs = _obj(row.get("kvtriton")), _obj(row.get("vllm"))
        adapter = _obj(row.get("kvtriton_via_vllm_adapter"))
        rows.append(
            [
                str(row.get("policy")).upper(),
                _count(_num(ours, "blocks_per_s")),
                _count(_num(theirs, "blocks_per_s")),
                _x(_num(row, "speedup")),
                f"{_pct(_num(ours, 'hit_rate'))} / {_pct(_num(theirs, 'hit_rate'))}",
                f"{_count(_num(adapter, 'blocks_per_s'))}, {_x(_num(row, 'adapter_speedup'))}, {_pct(_num(adapter, 'hit_rate'))}",
            ]
        )
    headers = [
        "policy",
        "kvtriton blocks/s",
        "vLLM blocks/s",
        "speed-up",
        "hit rate (kvtriton / vLLM)",
        "through the vLLM adapter: blocks/s, speed-up, hit rate",
    ]
    caption = f"{_count(_num(record, 'capacity'))} slots, `{record.get('command')}`, {run_date(record)}, {run_machine(record)}:"
    return caption + "\n\n" + _table(headers, rows, "lrrrll")


def manager_direct_table(results: Results) -> str:
    return _direct_table(results("manager"))


def manager_cap2048_table(results: Results) -> str:
    return _direct_table(results("manager_cap2048"))


def manager_direct_range(results: Results) -> str:
    rows = {str(row.get("policy")): row for row in _list(results("manager").get("results"))}
    return f"ARC {_x(_num(rows['arc'], 'speedup'))}, LRU {_x(_num(rows['lru'], 'speedup'))}"


def manager_hit_rates_table(results: Results) -> str:
    record = results("manager_hit_rates")
    headers = [str(header) for header in cast(list[object], record.get("headers"))]
    rows = [[str(cell) for cell in cast(list[object], row)] for row in cast(list[object], record.get("rows"))]
    return _table(headers, rows, "l" + "r" * (len(headers) - 1))


# -- kernels (bench/kernels.py) -------------------------------------------------------------------------


_PATTERNS = {
    ("random", "consecutive"): "**random GPU blocks, consecutive slab rows (headline)**",
    ("random", "random"): "random blocks, random rows",
    ("runs", "consecutive"): "runs of 16 blocks, consecutive rows",
    ("runs", "random"): "runs of 16 blocks, random rows",
}


def _kernel_rows(results: Results, group: str) -> list[JSONObject]:
    return [row for row in _list(results("kernels").get("results")) if row.get("group") == group]


def _methods(rows: Sequence[JSONObject]) -> list[str]:
    return list(dict.fromkeys(str(row["method"]) for row in rows if row.get("method") != "contiguous"))


def kernels_headline_table(results: Results) -> str:
    rows = _kernel_rows(results, "headline")
    methods = _methods(rows)
    columns = [(kernel, method) for kernel in ("gather", "scatter") for method in methods]
    by_key = {(str(r["pattern"]), str(r["rows"]), str(r["kernel"]), str(r["method"])): r for r in rows}
    table: list[list[str]] = []
    for (pattern, slab_rows), label in _PATTERNS.items():
        cells = [label]
        for kernel, method in columns:
            row = by_key.get((pattern, slab_rows, kernel, method))
            if row is None:
                cells.append("-")
                continue
            ratio = f"{_num(row, 'vs_contiguous'):.2f}"
            if pattern == "random" and slab_rows == "consecutive" and method != "loop":
                ratio = f"**{ratio}** ({gb_per_s(row):.1f} GB/s)"
            cells.append(ratio)
        table.append(cells)
    headers = [
        "block pattern",
        *(f"{kernel} {'per-block loop' if method == 'loop' else method}" for kernel, method in columns),
    ]
    return _table(headers, table, "l" + "r" * len(columns))


def _headline(results: Results, kernel: str, method: str) -> JSONObject:
    wanted = (kernel, method, "random", "consecutive")
    for row in _kernel_rows(results, "headline"):
        if (row.get("kernel"), row.get("method"), row.get("pattern"), row.get("rows")) == wanted:
            return row
    raise RenderError(f"kernels.json has no headline {kernel} row for {method}")


def kernels_fallback_ratio(results: Results) -> str:
    return " / ".join(
        f"{_num(_headline(results, kernel, 'torch'), 'vs_contiguous'):.2f}" for kernel in ("gather", "scatter")
    )


def kernels_contiguous_range(results: Results) -> str:
    speeds = [gb_per_s(row) for row in _kernel_rows(results, "headline") if row.get("method") == "contiguous"]
    return f"{min(speeds):.1f}-{max(speeds):.1f} GB/s"


def _page(size: float) -> str:
    return f"{size / 1024:g} KiB" if size >= 1024 else f"{size:g} B"


def kernels_page_sizes(results: Results) -> str:
    rows = [row for row in _kernel_rows(results, "sweep") if row.get("method") == "torch"]
    by_size: dict[float, dict[str, float]] = {}
    for row in rows:
        by_size.setdefault(_num(row, "page_bytes"), {})[str(row["kernel"])] = _num(row, "vs_contiguous")
    return ", ".join(
        f"{by['gather']:.2f} / {by['scatter']:.2f} at {_page(size)}"
        for size, by in sorted(by_size.items())
        if "gather" in by and "scatter" in by
    )


def kernels_triton_summary(results: Results) -> str:
    rows = [row for row in _list(results("kernels").get("results")) if row.get("method") == "triton"]
    if not rows:
        return (
            f"**not measured yet**: `bench/results/kernels.json` holds no GPU run ({run_machine(results('kernels'))})"
        )
    ratios = [_num(row, "vs_contiguous") for row in rows if _num(row, "page_bytes") >= 16384]
    return f"worst {min(ratios):.2f} of the contiguous copy for pages >= 16 KiB ({run_machine(results('kernels'))})"


def kernels_ptx_table(results: Results) -> str:
    def widths(counts: object) -> str:
        sizes = sorted((int(width) for width in _obj(counts)), reverse=True)
        return ", ".join(f"{size}-byte" for size in sizes)

    table: list[list[str]] = []
    for row in _list(results("kernels_ptx").get("ptx")):
        multiplies = cast(list[object], row.get("narrow_multiplies") or [])
        table.append(
            [
                str(row.get("kernel")),
                widths(row.get("loads")),
                widths(row.get("stores")),
                "none" if not multiplies else f"{len(multiplies)}",
            ]
        )
    return _table(
        ["kernel, page size", "global loads", "global stores", "32-bit multiplies feeding an address"], table, "llll"
    )


def kernels_ptx_summary(results: Results) -> str:
    rows = _list(results("kernels_ptx").get("ptx"))
    aligned = [
        row
        for row in rows
        if re.fullmatch(r"(gather|scatter) \d+ B", str(row.get("kernel")))
        and int(str(row["kernel"]).split()[1]) % 16 == 0
    ]
    wide = all(
        max(int(width) for width in _obj(row.get(kind))) == 16 for row in aligned for kind in ("loads", "stores")
    )
    narrow = any(row.get("narrow_multiplies") for row in rows)
    return (
        f"{'16-byte' if wide else 'NOT all 16-byte'} loads and stores for every 16-byte-aligned page size;"
        f" {'a' if narrow else 'no'} 32-bit address multiply"
    )


# -- the worker's host path (bench/host_cost.py) --------------------------------------------------------


def engine_table(results: Results) -> str:
    table: list[list[str]] = []
    for row in _list(results("host_cost").get("results")):
        table.append(
            [
                _count(_num(row, "page_tensors")),
                _count(_num(row, "blocks")),
                f"{_num(row, 'current_us'):.1f} ({_num(row, 'current_median_us'):.1f})",
                f"{_num(row, 'baseline_us'):.0f} ({_num(row, 'baseline_median_us'):.0f})",
                f"{_num(row, 'speedup'):.0f}x",
                f"{_num(row, 'goal_us'):g}",
            ]
        )
    headers = ["page tensors", "blocks", "now (us/job)", "baseline (us/job)", "speed-up", "goal (us/job)"]
    return _table(headers, table, "rrrrrr")


def engine_summary(results: Results) -> str:
    rows = _list(results("host_cost").get("results"))
    worst = {int(_num(row, "page_tensors")): 0.0 for row in rows}
    for row in rows:
        count = int(_num(row, "page_tensors"))
        worst[count] = max(worst[count], _num(row, "current_median_us"))
    goals = {int(_num(row, "page_tensors")): _num(row, "goal_us") for row in rows}
    return "; ".join(
        f"{worst[count]:.1f} us at {count} page tensors (goal {goals[count]:g})" for count in sorted(worst)
    )


# -- tiers (bench/tiers.py, bench/tiers_mooncake.py) ----------------------------------------------------


def tiers_table(results: Results) -> str:
    table: list[list[str]] = []
    for row in _list(results("tiers").get("results")):
        theirs, ours = _obj(row.get("vllm")), _obj(row.get("kvtriton"))
        table.append(
            [
                f"{_num(row, 'chunk_bytes') / 2**20:g} MiB",
                str(row.get("direction")),
                _count(_num(theirs, "chunks_per_s")),
                f"{gb_per_s(theirs):.2f}",
                _count(_num(ours, "chunks_per_s")),
                f"{gb_per_s(ours):.2f}",
                f"{_num(row, 'ratio'):.2f}",
                f"{_num(row, 'median_ratio'):.2f}",
                f"{_num(row, 'vllm_vs_vllm_median_ratio'):.2f}",
            ]
        )
    headers = [
        "chunk",
        "direction",
        "vLLM chunks/s",
        "vLLM GB/s",
        "kvtriton chunks/s",
        "kvtriton GB/s",
        "ratio (best)",
        "ratio (median)",
        "vLLM/vLLM (A/A, median)",
    ]
    return _table(headers, table, "rlrrrrrrr")


def tiers_bookkeeping_table(results: Results) -> str:
    costs = _obj(results("tiers").get("bookkeeping_us_per_chunk"))
    table = [
        [name, *(f"{_num(_obj(costs[key]), field):.2f}" for field in ("write_us", "read_us", "lookup_us"))]
        for key, name in (("vllm", "vLLM"), ("kvtriton", "kvtriton"))
    ]
    headers = [
        "primary",
        "promotion slot (`prepare_write` + `complete_write`)",
        "cascade pin (`prepare_read` + `complete_read`)",
        "`lookup`",
    ]
    return _table(headers, table, "lrrr")


def tiers_summary(results: Results) -> str:
    record = results("tiers")
    return (
        f"worst {_num(record, 'worst_ratio'):.2f} (best passes), {_num(record, 'worst_median_ratio'):.2f} by median;"
        f" vLLM against itself moves by up to {_num(record, 'vllm_vs_vllm_noise'):.2f}"
    )


def _step_variants(results: Results) -> dict[str, JSONObject]:
    return {str(row.get("variant")): row for row in _list(results("tiers_steps").get("variants"))}


def tiers_steps_table(results: Results) -> str:
    """The scheduler thread's time in the tiered manager per step, per variant: median and range of the rounds."""
    table = [
        [
            str(row.get("what")),
            f"{_num(row, 'median_ms'):.3f}",
            f"{_num(row, 'low_ms'):.3f} to {_num(row, 'high_ms'):.3f}",
            f"{_num(row, 'refused_steps'):g}",
        ]
        for row in _step_variants(results).values()
    ]
    headers = ["variant", "step time, ms (median)", "range of the rounds' medians, ms", "stores refused (primary full)"]
    return _table(headers, table, "lrrr")


def tiers_steps_setup(results: Results) -> str:
    record = results("tiers_steps")
    return (
        f"{_num(record, 'batch'):g} chunks of {_num(record, 'chunk_bytes') / 2**20:g} MiB stored per step,"
        f" {_num(record, 'steps'):g} steps per round, {_num(record, 'pause_ms'):g} ms between steps,"
        f" {_num(record, 'rounds'):g} rounds"
    )


def tiers_steps_summary(results: Results) -> str:
    variants = _step_variants(results)
    before, now, none = (
        _num(variants[name], "median_ms") for name in ("fs-sealed-on-scheduler", "fs-sealed-off-thread", "no-tier")
    )
    return (
        f"{before:.3f} ms per step with the seals on the scheduler thread, {now:.3f} ms with them on the seal thread,"
        f" against {none:.3f} ms without a secondary tier"
    )


def mooncake_table(results: Results) -> str:
    table: list[list[str]] = []
    for row in _list(results("tiers_mooncake").get("results")):
        table.append(
            [
                f"{_num(row, 'chunk_mib'):g} MiB",
                *(
                    f"{_num(row, key):.2f}"
                    for key in (
                        "mooncake_store_gbps",
                        "raw_store_gbps",
                        "fs_store_gbps",
                        "mooncake_load_gbps",
                        "raw_load_gbps",
                        "fs_load_gbps",
                        "store_overhead_ratio",
                        "load_overhead_ratio",
                    )
                ),
                *_encrypted_ratios(row),
                f"{_num(row, 'promotion_steps'):g} steps, {_num(row, 'promotion_ms'):.1f} ms",
            ]
        )
    headers = [
        "chunk",
        "tier store GB/s",
        "raw store",
        "fs store",
        "tier load GB/s",
        "raw load",
        "fs load",
        "store ratio",
        "load ratio",
        "sealed / clear store",
        "sealed / clear load",
        "promotion",
    ]
    return _table(headers, table, "rrrrrrrrrrrr")


def _encrypted_ratios(row: JSONObject) -> list[str]:
    """The tier's throughput with ``kvtriton_encryption`` over without it, store and load ("-": not measured then)."""
    if "mooncake_encrypted_store_gbps" not in row:
        return ["-", "-"]
    return [
        f"{_num(row, f'mooncake_encrypted_{direction}_gbps') / _num(row, f'mooncake_{direction}_gbps'):.2f}"
        for direction in ("store", "load")
    ]


def mooncake_summary(results: Results) -> str:
    rows = _list(results("tiers_mooncake").get("results"))
    worst = min(min(_num(row, "store_overhead_ratio"), _num(row, "load_overhead_ratio")) for row in rows)
    return f"worst ratio {worst:.2f}"


# -- fp8-e4m3 compression (bench/compression.py) -------------------------------------------------------


def compression_table(results: Results) -> str:
    """Per scheme: K and V relative RMS error, the largest K error over its RMS, the attention output's error."""
    accuracy = _obj(results("compression").get("accuracy"))
    table = [
        [
            f"`{name}`",
            *(f"{_pct(_num(figures, key))}" for key in ("k_relative_rms_error", "v_relative_rms_error")),
            f"{_num(figures, 'k_max_error_over_rms'):.2f}",
            *(f"{_pct(_num(figures, key))}" for key in ("attention_relative_error", "attention_relative_error_k_only")),
            f"{_pct(max(_num(figures, 'k_share_over_bound'), _num(figures, 'v_share_over_bound')))}",
        ]
        for name, figures in ((name, _obj(value)) for name, value in accuracy.items())
    ]
    headers = [
        "scheme",
        "K rel. RMS error",
        "V rel. RMS error",
        "K max error / RMS",
        "attention rel. error",
        "attention, K only",
        "elements over the bound",
    ]
    return _table(headers, table, "lrrrrrr")


def compression_bytes(results: Results) -> str:
    """Bytes per block and blocks per GiB against uncompressed rows, per page dtype."""
    parts = [
        f"{row.get('dtype')} {_num(row, 'engine_bytes_moved_ratio'):.3f}x the bytes moved, {_x(_num(row, 'blocks_per_gib_gain'))} the blocks per GiB"
        for row in _list(results("compression").get("bytes"))
    ]
    return "; ".join(parts)


def compression_tiny_table(results: Results) -> str:
    """The end-to-end tests' tiny model per scheme: K and V error, attention error, next-token agreement and drift."""
    tiny = results("compression").get("tiny_model")
    if isinstance(tiny, str):  # why the run measured no tiny model ("skipped (--prompts 0)", transformers missing)
        raise RenderError(
            f"bench/results/compression.json has no tiny-model figures ({tiny}): rerun python -m bench.compression"
        )
    table = [
        [
            f"`{name}`",
            *(
                f"{_pct(_num(figures, key))}"
                for key in (
                    "k_relative_rms_error",
                    "v_relative_rms_error",
                    "attention_relative_error",
                    "top1_agreement",
                    "first_token_top1_agreement",
                )
            ),
            f"{_num(figures, 'mean_abs_logprob_drift'):.3f}",
            f"{_num(figures, 'max_abs_logprob_drift'):.3f}",
            f"{_num(figures, 'mean_kl_nats'):.4f}",
        ]
        for name, figures in ((name, _obj(value)) for name, value in _obj(tiny).items())
    ]
    headers = [
        "scheme",
        "K rel. RMS error",
        "V rel. RMS error",
        "attention rel. error (all layers)",
        "top-1 agreement",
        "first token",
        "mean abs. logprob drift",
        "largest",
        "mean KL (nats)",
    ]
    return _table(headers, table, "lrrrrrrrr")


def _real_model(results: Results) -> JSONObject:
    real = results("compression").get("real_model")
    if isinstance(real, str):  # why the run measured no real model (skipped, offline)
        raise RenderError(
            f"bench/results/compression.json has no real-model figures ({real}): rerun python -m bench.compression"
        )
    return _obj(real)


def compression_real_engine_table(results: Results) -> str:
    """SmolLM2-135M through real vLLM engines: greedy agreement with the exact prefix, per run."""
    rows = [
        [
            f"`{name}`",
            f"{_num(f, 'first_token_agreement'):.0f}/{_num(f, 'prompts'):.0f}",
            f"{_num(f, 'sequence_agreement'):.0f}/{_num(f, 'prompts'):.0f}",
            f"{_num(f, 'mean_first_divergence'):.1f}",
            f"{_num(f, 'mean_abs_logprob_drift'):.4f}",
            f"{_num(f, 'max_abs_logprob_drift'):.4f}",
        ]
        for name, f in ((name, _obj(value)) for name, value in _obj(_real_model(results).get("engine")).items())
    ]
    headers = [
        "run",
        "first token agrees",
        "whole sequence agrees",
        "mean position of the first divergence",
        "mean abs. logprob drift",
        "largest",
    ]
    return _table(headers, rows, "lrrrrr")


def compression_real_summary(results: Results) -> str:
    """One sentence for the README: kvtriton fp8 against vLLM's fp8 KV cache on the real model."""
    engine = _obj(_real_model(results).get("engine"))

    def agreement(name: str) -> str:
        if name not in engine:
            return "was not measured (the CPU of that run has no AVX-512, which vLLM's CPU fp8 KV cache needs)"
        f = _obj(engine.get(name))
        return (
            f"agreed with the exact run on {_num(f, 'first_token_agreement'):.0f} of {_num(f, 'prompts'):.0f} prompts"
            f" and first diverged at token {_num(f, 'mean_first_divergence'):.1f} on average"
        )

    return (
        f"with kvtriton fp8 the first generated token {agreement('kvtriton fp8-e4m3')}; with vLLM's own"
        f' `kv_cache_dtype="fp8"` on the same prompts it {agreement("vLLM fp8 KV cache")}'
    )


def compression_real_teacher_table(results: Results) -> str:
    """SmolLM2-135M teacher-forced over a real text: per-token log-probability drift per scheme."""
    rows = [
        [
            f"`{name}`",
            _pct(_num(f, "top1_agreement")),
            f"{_num(f, 'mean_abs_logprob_drift'):.4f}",
            f"{_num(f, 'max_abs_logprob_drift'):.4f}",
            f"{_num(f, 'mean_kl_nats'):.5f}",
        ]
        for name, f in ((name, _obj(value)) for name, value in _obj(_real_model(results).get("teacher_forced")).items())
    ]
    return _table(["scheme", "top-1 agreement", "mean abs. logprob drift", "largest", "mean KL (nats)"], rows, "lrrrr")


def compression_real_setup(results: Results) -> str:
    real = _real_model(results)
    tokens = cast(list[object], real.get("prompt_tokens"))
    return (
        f"{_num(real, 'prompts'):.0f} chat prompts of {tokens[0]}-{tokens[1]} tokens "
        f"({_num(real, 'shared_prompt_tokens'):.0f} shared), {_num(real, 'generated_tokens'):.0f} greedy tokens each; "
        f"fp8 stored {_num(real, 'fp8_stored_bytes_ratio'):.3f}x the fp32 bytes"
    )


# -- the vLLM releases kvtriton supports (kvtriton/integrations/_vllm_release.py, the Makefile) ----------------


MAKEFILE = REPO / "Makefile"
_MAKE_RELEASES = {"VLLM_VERSION": "make test", "OTHER_VLLM_VERSION": "make compat-other"}
"""The Makefile variables that pin the vLLM each test environment installs, and the target that builds it."""


def makefile_vllm_versions(makefile: Path = MAKEFILE) -> dict[str, str]:
    """The vLLM version each test environment installs, by its ``make`` target: ``{"make test": "0.33.0", ...}``."""
    text = makefile.read_text(encoding="utf-8")
    versions: dict[str, str] = {}
    for variable, target in _MAKE_RELEASES.items():
        match = re.search(rf"^{variable} \?= (\S+)$", text, re.MULTILINE)
        if match is None:
            raise RenderError(f"{makefile.name} sets no `{variable} ?= <version>` (the vLLM `{target}` installs)")
        versions[target] = match.group(1)
    return versions


def _release(release: tuple[int, int]) -> str:
    return f"{release[0]}.{release[1]}.x"


def vllm_releases(results: Results) -> str:
    """``vLLM 0.33.x and 0.34.x``: the releases kvtriton is tested on (``results`` unused: no benchmark says it)."""
    names = [_release(release) for release in TESTED_VLLM_RELEASES]
    return "vLLM " + (names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}")


def vllm_requirement(results: Results) -> str:
    """```vllm>=0.33,<0.35```: the tested releases as the requirement pip takes."""
    return f"`vllm{TESTED_VLLM_RANGE}`"


def vllm_make_test(results: Results) -> str:
    """``vLLM 0.33.0``: the release ``make test`` installs and runs everything against."""
    return f"vLLM {makefile_vllm_versions()['make test']}"


def vllm_make_compat_other(results: Results) -> str:
    """``vLLM 0.34.0``: the other release, which ``make compat-other`` installs in a venv of its own."""
    return f"vLLM {makefile_vllm_versions()['make compat-other']}"


def vllm_releases_table(results: Results) -> str:
    """Each tested release, the ``make`` target that tests it (and on which version), and what any other one gets."""
    tested_by: dict[tuple[int, int], list[str]] = {release: [] for release in TESTED_VLLM_RELEASES}
    for target, version in makefile_vllm_versions().items():
        release = vllm_release(version)
        if release not in tested_by:
            raise RenderError(
                f"`{target}` installs vLLM {version}, which is not one of the tested releases {tested_releases()} "
                "(TESTED_VLLM_RELEASES in kvtriton/integrations/_vllm_release.py): change one of them"
            )
        tested_by[release].append(f"`{target}`, on vLLM {version}")
    rows: list[list[str]] = []
    for release, targets in tested_by.items():
        if not targets:
            raise RenderError(
                f"no make target installs vLLM {_release(release)}; set VLLM_VERSION or OTHER_VLLM_VERSION"
            )
        rows.append([_release(release), "supported", "; ".join(targets)])
    rows.append(
        [
            "any other",
            f"refused when the spec is built, in one line naming the installed and the tested releases; "
            f"`{ALLOW_UNTESTED_VLLM}=1` starts it anyway, with a WARNING",
            "not tested",
        ]
    )
    return _table(["vLLM", "kvtriton", "tested by"], rows, "lll")


# -- the summary --------------------------------------------------------------------------------------


def summary_table(results: Results) -> str:
    def when(name: str) -> str:
        return _dated(name)(results)

    goals = {
        f"<= {_num(r, 'goal_us'):g} us at {_num(r, 'page_tensors'):g} page tensors"
        for r in _list(results("host_cost").get("results"))
    }
    engine_goals = ", ".join(sorted(goals))
    rows = [
        [
            "manager blocks/s vs vLLM 0.33's `CPUOffloadingManager`, kvtriton through its vLLM adapter, vLLM's call order, 4 workloads",
            f">= {MANAGER_SPEEDUP_GOAL:g}x for both policies on every workload, hit rate no lower",
            f"{manager_headline_range(results)}; {manager_headline_verdict(results).split(': ', 1)[1]}",
            when("manager"),
            "[manager](#scheduler-side-manager)",
        ],
        [
            "the same, kvtriton's own API (direct calls, `prefix-sharing` trace)",
            f"none of its own (the first goal, 2x, became the {MANAGER_SPEEDUP_GOAL:g}x above)",
            manager_direct_range(results),
            when("manager"),
            "[direct calls](#direct-calls-kvtritons-own-api)",
        ],
        [
            "CPU fallback gather / scatter vs one contiguous copy, Llama-3-8B job",
            f">= {KERNEL_FALLBACK_GOAL:g}",
            kernels_fallback_ratio(results),
            when("kernels"),
            "[kernels on CPU](#kernels-on-cpu-the-torch-fallback)",
        ],
        [
            "Triton kernels vs contiguous copy (pages >= 16 KiB), vs per-block loop (4-32 KiB), GPU",
            ">= 0.9, >= 5x",
            kernels_triton_summary(results),
            when("kernels"),
            "[kernels on GPU](#kernels-on-a-gpu)",
        ],
        [
            "kernels' generated code for sm_90",
            "16-byte accesses, 64-bit address math",
            kernels_ptx_summary(results),
            when("kernels_ptx"),
            "[PTX](#generated-code-no-gpu-needed)",
        ],
        [
            "engine host cost per job (kernel launch stubbed), median",
            engine_goals,
            engine_summary(results),
            when("host_cost"),
            "[engine](#engine-host-cost-per-job)",
        ],
        [
            "tier traffic through kvtriton's primary vs vLLM's CPU primary, behind the `fs` tier",
            ">= 0.95",
            tiers_summary(results),
            when("tiers"),
            "[tiers](#tiered-offloading-kvtritons-primary-tier-vs-vllms-cpu-primary-benchtierspy)",
        ],
        [
            "Mooncake Store tier vs the raw Mooncake calls on the same chunks",
            f">= {_num(results('tiers_mooncake'), 'overhead_goal'):g}",
            mooncake_summary(results),
            when("tiers_mooncake"),
            "[Mooncake](#mooncake-store-tier-cascade-promotion-and-overhead-benchtiers_mooncakepy)",
        ],
        [
            "`vllm serve` TTFT and throughput, kvtriton against no connector and the ceiling (the engine's cache given kvtriton's host bytes)",
            *serving_goal_row(results),
            when("serving"),
            "[serving](#serving-ttft-and-throughput-against-the-ceiling-benchservingpy)",
        ],
    ]
    return _table(["what", "goal", "measured", "run", "where"], rows, "lllll")


def _dated(name: str) -> Callable[[Results], str]:
    def render(results: Results) -> str:
        return f"{run_date(results(name))}, {run_machine(results(name))}"

    return render


_NAMED_AFTER_THEMSELVES = (
    manager_headline_table,
    manager_headline_range,
    manager_headline_verdict,
    manager_before_range,
    manager_direct_table,
    manager_direct_range,
    manager_cap2048_table,
    manager_hit_rates_table,
    kernels_headline_table,
    kernels_fallback_ratio,
    kernels_contiguous_range,
    kernels_page_sizes,
    kernels_ptx_table,
    engine_table,
    engine_summary,
    tiers_table,
    tiers_bookkeeping_table,
    tiers_summary,
    tiers_steps_table,
    tiers_steps_setup,
    tiers_steps_summary,
    mooncake_table,
    mooncake_summary,
    compression_table,
    compression_bytes,
    compression_tiny_table,
    compression_real_engine_table,
    compression_real_teacher_table,
    compression_real_setup,
    compression_real_summary,
    vllm_releases,
    vllm_requirement,
    vllm_make_test,
    vllm_make_compat_other,
    vllm_releases_table,
)
"""The renderers whose region is their own name with dashes: ``manager_headline_table`` renders
``manager-headline-table``, so a region's name and its function cannot drift apart."""

RENDERERS: dict[str, Callable[[Results], str]] = {
    "summary": summary_table,
    **{renderer.__name__.replace("_", "-"): renderer for renderer in _NAMED_AFTER_THEMSELVES},
    **SIMULATE_RENDERERS,
    **SERVING_RENDERERS,
    **{
        f"run-{name}": _dated(name)
        for name in (
            "manager",
            "manager_cap2048",
            "manager_hit_rates",
            "kernels",
            "kernels_ptx",
            "host_cost",
            "tiers",
            "tiers_mooncake",
            "tiers_steps",
            "compression",
            "serving",
        )
    },
}
"""Every region name the docs may use, and what renders it."""


def render_text(text: str, results: Results, where: str = "") -> str:
    """``text`` with every generated region rewritten; a RenderError names the region that failed."""

    def replace(match: re.Match[str]) -> str:
        name, body = match.group("name"), match.group("body")
        renderer = RENDERERS.get(name)
        if renderer is None:
            raise RenderError(f"{where}: unknown generated region {name!r} (known: {', '.join(sorted(RENDERERS))})")
        try:
            rendered = renderer(results)
        except (RenderError, KeyError, TypeError) as error:
            raise RenderError(f"{where}: region {name!r}: {error}") from None
        inner = f"\n{rendered}\n" if body.startswith("\n") else rendered
        return f"<!-- generated:{name} -->{inner}<!-- /generated:{name} -->"

    return MARKER.sub(replace, text)


def documents(repo: Path = REPO) -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]


def stale_regions(path: Path, results: Results) -> list[str]:
    """The names of the regions of ``path`` whose text differs from what the results render."""
    text = path.read_text(encoding="utf-8")
    fresh = render_text(text, results, str(path))
    old = {m.start(): (m.group("name"), m.group(0)) for m in MARKER.finditer(text)}
    new = [m.group(0) for m in MARKER.finditer(fresh)]
    return [name for (name, region), renewed in zip(old.values(), new) if region != renewed]


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser("render_docs", __doc__)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming every stale region")
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="folder of the result files (default: bench/results)"
    )
    args = parser.parse_args(argv)
    results = Results(args.results)
    stale: list[str] = []
    try:
        for path in documents():
            text = path.read_text(encoding="utf-8")
            fresh = render_text(text, results, str(path.relative_to(REPO)))
            if fresh == text:
                continue
            names = ", ".join(stale_regions(path, results))
            if args.check:
                stale.append(f"{path.relative_to(REPO)}: {names}")
            else:
                path.write_text(fresh, encoding="utf-8")
                print(f"rewrote {path.relative_to(REPO)}: {names}")
    except RenderError as error:
        print(f"render_docs: error: {error}", file=sys.stderr)
        return 2
    if stale:
        print("stale figures (run `python -m bench.render_docs` and commit):\n  " + "\n  ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
