"""`kvtriton simulate`'s output: the tables, the answer's lines, the JSON record, the plot."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, TypeVar, cast

from kvtriton.cli._main import command_error
from kvtriton.cli._progress import ProgressBar, progress
from kvtriton.cli._simulate._arguments import Source
from kvtriton.cli._simulate._computation import HostSweep, TieredSweep
from kvtriton.sim import (
    COMPRESSION_EXTRA_CONFIG_KEY,
    GIB,
    MAX_DEFERRALS,
    CallOrder,
    ModelGeometry,
    PointReport,
    Recommendation,
    TieredRecommendation,
    TieredReport,
    TierSpec,
    TraceSummary,
    VllmOrder,
    format_bytes,
    summarize,
)

GridT = TypeVar("GridT")


def percent(rate: float) -> str:
    return f"{100 * rate:.1f}%"


def gib(size: float) -> str:
    gib = size / GIB
    return f"{gib:.3g}" if gib < 1000 else f"{gib:,.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a table: right-aligned columns under their headers and a rule."""
    widths = [max([len(header), *(len(row[i]) for row in rows)]) for i, header in enumerate(headers)]
    lines = ["  ".join(header.rjust(width) for header, width in zip(headers, widths))]
    lines.append("  ".join("-" * width for width in widths))
    return lines + ["  ".join(value.rjust(width) for value, width in zip(row, widths)) for row in rows]


def recommendation_lines(
    found: Recommendation, order: CallOrder, geometry: ModelGeometry, ceiling: float, largest: int, working_set: int
) -> list[str]:
    """The answer: the configuration of ``found``, or why no size reached the target.

    ``ceiling`` is the rate with room for the whole trace, ``largest`` the
    largest capacity tried and ``working_set`` the bytes the whole trace takes:
    they tell a target no host memory reaches from one that larger sizes would.
    """
    target = percent(found.target)
    point = found.point
    if point is None or found.kv_transfer_config is None or found.slab_bytes_per_rank is None:
        best = found.best
        lines = [
            f"NO SIZE TRIED REACHES THE TARGET: {found.rate_name} stays below {target} at every size tried;",
            f"  the best is {percent(best.rate(order.name))} ({best.policy.upper()}, {format_bytes(best.capacity_bytes)}).",
        ]
        rest = "first-time blocks, or blocks the GPU cache serves" if order.name == "vllm" else "first-time blocks"
        if ceiling < found.target - 1e-12:
            lines.append(
                f"  unreachable: the ceiling, {percent(ceiling)}, is below the target: no amount of host memory"
                f" reaches it (the rest are {rest}); lower --target-hit-rate"
            )
        elif largest < working_set:
            lines.append(
                f"  Try larger --capacities: the largest tried, {format_bytes(largest)}, holds less than the whole"
                f" trace ({format_bytes(working_set)}), with which the rate reaches {percent(ceiling)}."
            )
        else:
            lines.append(
                f"  The sizes tried hold the whole trace ({format_bytes(working_set)}): the ceiling,"
                f" {percent(ceiling)}, is all the offload tier gives; lower --target-hit-rate."
            )
        return lines
    flags = order.engine_settings(geometry.block_size, found.tensor_parallel_size).flags()
    slab = found.slab_bytes_per_rank
    workers = (
        "the worker process pins"
        if found.tensor_parallel_size == 1
        else f"each of the {found.tensor_parallel_size} worker processes pins"
    )
    lines = [
        f"smallest size reaching {target} ({found.rate_name}): {format_bytes(point.capacity_bytes)} with"
        f" {point.policy.upper()}, {percent(point.rate(order.name))}",
        "",
        *_serve_lines(found.extra_config, found.kv_transfer_config, flags),
        f"pinned:    {workers} its slab, {format_bytes(slab)} ({slab} bytes), in host RAM (RLIMIT_MEMLOCK does"
        f" not limit it); check with: kvtriton info --slab-size {slab}B",
        f"/dev/shm:  not used by KVTritonOffloadingSpec (each rank's slab is its own memory); the tiering spec"
        f" (KVTritonTieringOffloadingSpec) maps the slab from /dev/shm and needs about {format_bytes(point.capacity_bytes)} free there",
        f"host RAM:  {format_bytes(slab * found.tensor_parallel_size)} for the slab(s), on top of vLLM's own",
    ]
    if geometry.compression != "none":
        lines.append(
            f"lossy:     {COMPRESSION_EXTRA_CONFIG_KEY}={geometry.compression} stores fp8 codes plus one scale per"
            f" {geometry.compression_group_size} elements: loaded KV differs from what was computed (docs/kernels.md,"
            ' "Compressed rows"); leave it out for bit-exact offload'
        )
    lines += engine_notes(order)
    return lines


def engine_notes(order: CallOrder) -> list[str]:
    """What the printed ``vllm serve`` line leaves to vLLM, or sets only because the model did."""
    if not isinstance(order, VllmOrder):
        return [
            "note:      --call-order kvtriton models no vLLM scheduler: the line sets the block size and parallelism only;"
            " --call-order vllm plans the server's scheduler settings too and writes them on the line"
        ]
    if order.gpu_blocks is None:
        return [
            "note:      modelled with the engine's prefix cache off (--no-enable-prefix-caching on the line) and no"
            " GPU block limit; give --gpu-blocks (vLLM's num_gpu_blocks) to model it on, as vLLM runs by default,"
            " counting only what the GPU cache does not serve"
        ]
    return []


def _serve_lines(extra_config: object, transfer_config: object, flags: Sequence[str]) -> list[str]:
    """How to start vLLM with the configuration found: its extra config, then the `vllm serve` command line."""
    return [
        "kv_connector_extra_config:",
        "  " + json.dumps(extra_config),
        "",
        *serve_command_lines(transfer_config, flags),
    ]


def offloading_transfer_config(extra_config: object) -> dict[str, object]:
    """vLLM's ``--kv-transfer-config`` for its OffloadingConnector with ``extra_config`` (a tiered or fleet answer)."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra_config}


def serve_command_lines(transfer_config: object, flags: Sequence[str]) -> list[str]:
    """The `vllm serve` command line that starts the server with ``transfer_config``, and a blank line."""
    return [
        "vllm serve <model> " + " ".join(flags) + " \\",
        f"  --kv-transfer-config '{json.dumps(transfer_config, separators=(',', ':'))}'",
        "",
    ]


class _Axes(Protocol):
    """The few matplotlib Axes methods the plot uses, typed (matplotlib's stubs leave ``**kwargs`` unknown)."""

    def plot(
        self,
        x: Sequence[float],
        y: Sequence[float],
        *,
        marker: str,
        linestyle: str,
        markersize: float,
        markerfacecolor: str,
        label: str,
    ) -> object: ...
    def axhline(self, y: float, *, color: str, linestyle: str, linewidth: float, label: str) -> object: ...
    def axvline(self, x: float, *, color: str, linestyle: str, linewidth: float, label: str) -> object: ...
    def set_xscale(self, value: str, *, base: int) -> None: ...
    def set_xticks(self, ticks: Sequence[float], labels: Sequence[str]) -> object: ...
    def minorticks_off(self) -> None: ...
    def set_xlabel(self, label: str) -> object: ...
    def set_ylabel(self, label: str) -> object: ...
    def set_ylim(self, bottom: float, top: float) -> object: ...
    def set_title(self, label: str, *, fontsize: int) -> object: ...
    def grid(self, visible: bool, *, which: str, alpha: float) -> None: ...
    def legend(self, *, loc: str) -> object: ...


class _Figure(Protocol):
    def tight_layout(self) -> None: ...
    def savefig(self, fname: Path, *, dpi: int, metadata: dict[str, str]) -> None: ...


_LINE_STYLES = (("o", "-", 8.0, "none"), ("s", "--", 5.0, "auto"), ("^", ":", 6.0, "none"), ("D", "-.", 4.0, "auto"))
"""Per policy: marker, line style, marker size, face. Hollow big markers around small full ones keep
policies that coincide (LRU and ARC at large sizes) visible on top of each other."""


def plot_stamp(record: Mapping[str, object]) -> str:
    """What a plot says about the run it was drawn from: the command line and a digest of the points plotted.

    ``kvtriton simulate`` writes it into the PNG's ``Source`` text, so a figure
    can be checked against the JSON record of the same run (the docs' figures are).
    """
    points = json.dumps(record["points"], sort_keys=True).encode()
    argv = cast("Sequence[str]", record["argv"])
    return f"kvtriton simulate {' '.join(argv)}; points sha256 {hashlib.sha256(points).hexdigest()}"


def plot(
    path: Path,
    reports: Sequence[PointReport],
    title: str,
    ceiling: float,
    working_set_gib: float,
    order: str,
    target: float,
    compressed_working_set_gib: float | None = None,
    *,
    stamp: str,
) -> None:
    """The hit rate against capacity (vLLM's reported rate in its order), one line per policy and compression.

    The dashed line is the ceiling, the red one ``target``. With compression,
    each policy has two lines (``LRU`` and ``LRU, fp8-e4m3``) and a second
    "whole trace fits" mark where the compressed trace fits. ``stamp`` goes into
    the PNG's ``Source`` text (see :func:`plot_stamp`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw_figure, raw_axes = plt.subplots(figsize=(7.5, 4.5))
    figure, axes = cast(_Figure, raw_figure), cast(_Axes, raw_axes)
    curves = dict.fromkeys((report.compression, report.policy) for report in reports)
    for index, (compression, policy) in enumerate(curves):
        mine = [report for report in reports if (report.compression, report.policy) == (compression, policy)]
        marker, linestyle, size, face = _LINE_STYLES[index % len(_LINE_STYLES)]
        label = policy.upper() if not compression or compression == "none" else f"{policy.upper()}, {compression}"
        axes.plot(
            [report.capacity_gib for report in mine],
            [100 * report.rate(order) for report in mine],
            marker=marker,
            linestyle=linestyle,
            markersize=size,
            markerfacecolor=face,
            label=label,
        )
    axes.axhline(100 * ceiling, color="grey", linestyle="--", linewidth=1, label="unlimited memory")
    axes.axhline(100 * target, color="tab:red", linestyle="-", linewidth=1, label=f"target {percent(target)}")
    axes.axvline(working_set_gib, color="grey", linestyle=":", linewidth=1, label="whole trace fits")
    if compressed_working_set_gib is not None:
        axes.axvline(
            compressed_working_set_gib, color="grey", linestyle="-.", linewidth=1, label="whole trace fits, compressed"
        )
    axes.set_xscale("log", base=2)
    ticks = sorted({report.capacity_gib for report in reports})
    axes.set_xticks(ticks, labels=[f"{tick:.3g}" for tick in ticks])
    axes.minorticks_off()
    axes.set_xlabel("host memory for the KV cache (GiB, log scale)")
    if order == "vllm":
        axes.set_ylabel("hit rate vLLM reports (%): external hits / queries")
    else:
        axes.set_ylabel("prompt tokens served from host memory (%)")
    axes.set_ylim(0, 100)
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="best")
    figure.tight_layout()
    figure.savefig(path, dpi=120, metadata={"Source": stamp})
    plt.close(raw_figure)


def curve_heading(compression: str, stored: ModelGeometry) -> str:
    if compression == "none":
        return f"uncompressed rows, {format_bytes(stored.bytes_per_block)} per block"
    passthrough = (
        " (an fp8 cache passes through unchanged)"
        if stored.compressed_bytes_per_block == stored.bytes_per_block
        else ""
    )
    return (
        f"lossy {compression} rows, {format_bytes(stored.stored_bytes_per_block)} per block"
        f" ({stored.compression_ratio:.3f}x the bytes moved, {1 / stored.compression_ratio:.2f}x the blocks per GiB){passthrough}"
    )


def uncompressed_line(uncompressed: Recommendation, found: Recommendation, order: str) -> str:
    """How the recommendation compares with the sweep without compression."""
    if uncompressed.point is None:
        return f"without compression: no size tried reaches {percent(uncompressed.target)}"
    size = format_bytes(uncompressed.point.capacity_bytes)
    rate = percent(uncompressed.point.rate(order))
    if found.point is None:
        return f"without compression: {size} with {uncompressed.point.policy.upper()}, {rate}"
    return f"without compression: {size} with {uncompressed.point.policy.upper()}, {rate} (compressed: {format_bytes(found.point.capacity_bytes)})"


def recommendation_record(found: Recommendation, geometry: ModelGeometry) -> dict[str, object]:
    return {
        "kv_compression": geometry.compression,
        "target_hit_rate": found.target,
        "rate": found.rate_name,
        "reached": found.point is not None,
        "policy": found.point.policy if found.point is not None else None,
        "capacity_bytes": found.point.capacity_bytes if found.point is not None else None,
        "kv_connector_extra_config": found.extra_config,
        "kv_transfer_config": found.kv_transfer_config,
        "slab_bytes_per_rank": found.slab_bytes_per_rank,
        "tensor_parallel_size": found.tensor_parallel_size,
    }


def describe_server(order: VllmOrder) -> str:
    if order.sequential:
        arrivals = "one request at a time"
    elif order.concurrency is not None:
        arrivals = f"{order.concurrency} requests in flight (the next sent once one finished)"
    elif order.request_rate is not None:
        arrivals = f"Poisson arrivals, {order.request_rate:g} requests per step (seed {order.arrival_seed})"
    elif order.arrivals is not None:
        arrivals = f"{order.arrivals} arrivals per step"
    else:
        arrivals = "all requests at once"
    parts = [
        arrivals,
        f"max_num_seqs {order.max_num_seqs}",
        f"{order.max_num_batched_tokens} batched tokens",
        f"{order.gpu_blocks} GPU blocks, prefix cache on" if order.gpu_blocks is not None else "prefix cache off",
        f"{order.decode_steps} output tokens",
        f"loads done after {order.load_steps} step(s), stores after {order.store_steps}",
    ]
    return ", ".join(parts)


COLUMNS: dict[str, Callable[[PointReport], str]] = {
    "policy": lambda report: report.policy,
    "GiB": lambda report: gib(report.capacity_bytes),
    "blocks": lambda report: str(report.num_blocks),
    "vLLM hit": lambda report: percent(report.external_hit_rate),
    "GPU": lambda report: percent(report.gpu_share),
    "host": lambda report: percent(report.offload_share),
    "computed": lambda report: percent(report.computed_share),
    "hit blk": lambda report: percent(report.block_hit_rate),
    "hit tok": lambda report: percent(report.token_hit_rate),
    "loaded GiB": lambda report: gib(report.bytes_loaded),
    "stored GiB": lambda report: gib(report.bytes_stored),
    "evictions": lambda report: str(report.evictions),
    "refused": lambda report: str(report.refused_stores),
    "load s": lambda report: f"{report.load_seconds:.2f}",
    "store s": lambda report: f"{report.store_seconds:.2f}",
}
"""The columns of a sweep's table: each header and how a point fills it."""

TABLE_HEADERS: dict[str, tuple[str, ...]] = {
    "vllm": ("policy", "GiB", "blocks", "vLLM hit", "GPU", "host", "computed", "loaded GiB", "stored GiB",
             "evictions", "refused", "load s", "store s"),
    "kvtriton": ("policy", "GiB", "blocks", "hit blk", "hit tok", "stored GiB", "loaded GiB",
                 "evictions", "refused", "load s", "store s"),
}  # fmt: skip  # a table: one output kind per line
"""The table's columns per call order: in vLLM's, its reported rate and where prompt tokens came from; else the
host tier's rates."""


def tier_heading(tier: TierSpec, servers: int) -> str:
    shared = f", shared by {servers} servers" if servers > 1 else ""
    return f"{tier.model.heading}{shared}"


def properties(value: object, names: Iterable[str]) -> dict[str, object]:
    """``value``'s attributes ``names`` under their own names: the derived figures a record adds to the counts."""
    return {name: getattr(value, name) for name in names}


def tiered_point_record(report: TieredReport, ratio: float) -> dict[str, object]:
    derived = ("external_hit_rate", "host_served_rate", "tier_served_rate", "host_chunk_hit_rate",
               "tier_chunk_hit_rate", "tier_read_bytes", "tier_write_bytes", "tier_fill_bytes")  # fmt: skip
    return {**asdict(report), **properties(report, derived), "cost_tier_gib": report.cost(ratio)}


def tiered_rows(reports: Sequence[TieredReport], ratio: float) -> tuple[list[str], list[list[str]]]:
    """Per (host size, tier size): the rate vLLM reports, the share each tier served (they add up to it), vLLM's
    first-lookup chunk counters, the bytes each tier moves, the cost."""
    headers = ["policy", "host GiB", "tier GiB", "vLLM hit", "host hit", "tier hit", "1st lookup host",
               "1st lookup tier", "promoted", "host load GiB", "host store GiB", "tier read GiB", "tier write GiB",
               "tier evictions", "cost"]  # fmt: skip  # a table: the header row as printed
    rows: list[list[str]] = []
    for report in reports:
        sized = report.tier.model.sized  # else the tier's column is what it filled
        counts = report.counts
        if counts is None:  # stalled: the replay stopped, so there is nothing to count
            tier_size = gib(report.tier.capacity_bytes or 0) if sized else "-"
            counted = ["stalled", *["-"] * 11]
        else:
            tier_size = gib(report.tier_size_bytes) if sized else f"{gib(report.tier_fill_bytes)} filled"
            counted = [
                percent(report.external_hit_rate),
                percent(report.host_served_rate),
                percent(report.tier_served_rate),
                f"{counts.host_chunk_hits}/{counts.host_chunk_queries}",
                f"{counts.tier_chunk_hits}/{counts.tier_chunk_queries}",
                str(counts.promotions),
                gib(report.host_load_bytes),
                gib(report.host_store_bytes),
                gib(report.tier_read_bytes),
                gib(report.tier_write_bytes),
                str(counts.tier_evictions),
                f"{report.cost(ratio):.3g}",
            ]
        rows.append([report.policy, gib(report.host_bytes), tier_size, *counted])
    return headers, rows


def stall_lines(stalled: Sequence[TieredReport], geometry: ModelGeometry) -> list[str]:
    """Why each stalled point stalled, from what its replay saw, and what that means for the answer."""
    lines = [
        f"stalled: a request waited {MAX_DEFERRALS} steps and never ran; vLLM 0.33's engine, whose tiered offloading"
        " the replay follows call by call, would wait on it the same way. The answer skips these points:"
    ]
    self_evicting: set[str] = set()
    for report in stalled:
        point = f"  {report.policy.upper()}, host {format_bytes(report.host_bytes)}, {report.tier.describe()}:"
        stall = report.stall
        if stall is None:
            lines.append(f"{point} a request never ran")
            continue
        request = f"request {stall.req_id!r} ({stall.prompt_chunks} chunks of prompt)"
        if not stall.fits:
            needed = format_bytes(stall.prompt_chunks * geometry.tiered_chunk_bytes)
            lines.append(
                f"{point} {request} does not fit the host tier's {stall.host_chunks} chunks: promoting the rest of"
                f" it evicts what was promoted before; give each server at least {needed} of host memory"
            )
        elif stall.own_evictions:
            self_evicting.add(report.policy)
            lines.append(
                f"{point} {request} fits the host tier's {stall.host_chunks} chunks, but its own promotions evicted"
                f" chunks it had already found, step after step ({stall.own_evictions} evictions)"
            )
        else:
            lines.append(f"{point} {request} fits the host tier, but its lookups never all hit in one step")
    if self_evicting:
        why = (
            "LRU ranks a waiting request's chunks by when it was first seen (tails first), so as other requests"
            " finish, they rank below everything else"
            if "lru" in self_evicting
            else "the policy ranked them below everything else"
        )
        lines.append(
            "  A request that fits stalls when the host tier is full and the chunks it found rank lowest there: a"
            f" lookup does not renew a chunk, and {why}; each chunk it promotes from the tier then evicts one it"
            " found. Whether that happens depends on the order in which the requests meet, not on the size alone,"
            " so a neighbouring size may not stall; do not deploy a stalled point."
        )
    return lines


def unreached_lines(shortfall: str, best: str) -> list[str]:
    """A tiered or fleet sweep's answer when no point reached the target: the ``shortfall``, the ``best`` point."""
    return [
        f"NO POINT TRIED REACHES THE TARGET: {shortfall};",
        f"  the best is {best}: try larger --capacities or --tier-sizes, or lower --target-hit-rate.",
    ]


def lossy_tiers_lines(geometry: ModelGeometry) -> list[str]:
    """With compressed rows, the line saying both tiers hold them (none without)."""
    if geometry.compression == "none":
        return []
    return [f"lossy:     {COMPRESSION_EXTRA_CONFIG_KEY}={geometry.compression}: both tiers hold the compressed rows"]


def tiered_recommendation_lines(
    found: TieredRecommendation, order: VllmOrder, geometry: ModelGeometry, servers: int, tensor_parallel_size: int
) -> list[str]:
    target = percent(found.target)
    point = found.point
    price = f"host memory priced {found.host_price_ratio:g}x a tier GiB"
    if point is None or found.extra_config is None:
        best = found.best
        return unreached_lines(
            f"the hit rate vLLM reports stays below {target} ({price})",
            f"{percent(best.external_hit_rate)} ({best.policy.upper()}, host {format_bytes(best.host_bytes)},"
            f" {best.tier.describe()})",
        )
    tier = point.tier.model
    tier_size = format_bytes(point.tier_size_bytes)  # a sized tier's capacity, else what it filled
    per_server = " per server" if servers > 1 else ""
    flags = order.engine_settings(geometry.block_size, tensor_parallel_size).flags()
    return [
        f"cheapest point reaching {target} (the hit rate vLLM reports; {price}):"
        f" {format_bytes(point.host_bytes)} of host memory{per_server} with {point.policy.upper()} and {tier.bought_as.format(size=tier_size)},"
        f" {percent(point.external_hit_rate)} (cost {point.cost(found.host_price_ratio):.3g} tier-GiB)",
        "",
        *_serve_lines(found.extra_config, offloading_transfer_config(found.extra_config), flags),
        f"/dev/shm:  the tiering spec maps its host memory there: about {format_bytes(point.host_bytes)} free",
        tier.deployment.format(size=tier_size),
        *lossy_tiers_lines(geometry),
    ]


@dataclass(frozen=True, slots=True)
class SweepProgress:
    """A sweep's ``track``: a progress bar on stderr over the points replayed, unless --no-progress."""

    args: argparse.Namespace

    def __call__(self, grid: Sequence[GridT]) -> Iterable[GridT]:
        return progress(grid, len(grid), "simulate", enabled=not self.args.no_progress)


def record_of(args: argparse.Namespace, source: Source, started: float, **fields: object) -> dict[str, object]:
    """A run's JSON record: the command, when and where it ran, the trace, ``fields``, the time taken."""
    record: dict[str, object] = {
        "command": "kvtriton simulate",
        "argv": cast("list[str]", getattr(args, "command_line", sys.argv[1:])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    record.update(
        rates="fractions of 1 (the printed table shows them as percentages)",
        source={"name": source.name, **source.description},
        **fields,
    )
    record["elapsed_seconds"] = time.perf_counter() - started
    return record


def write_and_print(args: argparse.Namespace, name: str, record: dict[str, object], lines: list[str]) -> Path | None:
    """Write ``record``, with ``lines`` as what was printed, as JSON to ``--out``/``name`` (the folder made when
    missing), then print ``lines`` (with --json, the record); None, said on stderr, when it cannot be written."""
    record["printed"] = lines
    out_dir: Path = args.out
    if out_dir.exists() and not out_dir.is_dir():
        command_error("simulate", f"--out {out_dir}: is a file, not a folder (name a folder, created when missing)")
        return None
    json_path = out_dir / name
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(record, indent=2) + "\n")
    except OSError as error:
        command_error("simulate", f"--out {out_dir}: cannot write results: {error}")
        return None
    print(json.dumps(record, indent=2) if args.json else "\n".join(lines))
    return json_path


def write_and_report(args: argparse.Namespace, name: str, record: dict[str, object], lines: list[str]) -> int:
    """:func:`write_and_print`, then the line naming the file written: the command's exit status (2: not written)."""
    json_path = write_and_print(args, name, record, lines)
    if json_path is None:
        return 2
    print(f"wrote {json_path}", file=sys.stderr if args.json else sys.stdout)
    return 0


StartBar = Callable[[int], Callable[[int], None]]
"""``start_bar(total requests)``: opens a progress bar and returns its ``advance``."""
SweepT = TypeVar("SweepT")


def run_tier_sweep(
    args: argparse.Namespace,
    name: str,
    sweep: Callable[[StartBar], SweepT],
    record: Callable[[SweepT], dict[str, object]],
    lines: Callable[[SweepT], list[str]],
) -> int:
    """Run ``sweep(start_bar)``, then :func:`write_and_report` its ``record`` and ``lines`` as ``name``: the command's
    exit status (ValueError or RuntimeError from the sweep: its error).

    The bars count requests, not points: one point of a long trace, of many servers or of a fleet takes minutes.
    """
    bars: list[ProgressBar] = []

    def start_bar(total: int) -> Callable[[int], None]:
        bar = ProgressBar(total, "simulate (requests)", enabled=not args.no_progress)
        bars.append(bar)
        return bar.advance

    try:
        result = sweep(start_bar)
    except (ValueError, RuntimeError) as error:
        return command_error("simulate", error)
    for bar in bars:
        bar.finish()
    return write_and_report(args, name, record(result), lines(result))


def tier_record_fields(
    args: argparse.Namespace, geometry: ModelGeometry, order: VllmOrder, distinct_blocks: int
) -> dict[str, object]:
    """The fields a tiered and a fleet record share: the tier, the price, the stored bytes, vLLM's settings."""
    return {
        "tier": args.tier.describe(),
        "host_price_ratio": args.host_price_ratio,
        "compression": geometry.compression,
        "stored_bytes_per_block": geometry.stored_bytes_per_block,
        "working_set_bytes": distinct_blocks * geometry.stored_bytes_per_block,
        "call_order": {"name": order.name, **asdict(order)},
        "engine_args": asdict(order.engine_settings(geometry.block_size, args.tensor_parallel_size)),
    }


def tier_sweep_lines(
    args: argparse.Namespace,
    source: Source,
    summary: TraceSummary,
    geometry: ModelGeometry,
    distinct_blocks: int,
    setup: Sequence[str],
    rows_of: Callable[[str], tuple[list[str], list[list[str]]]],
    key: str,
    stalled: Sequence[TieredReport],
) -> list[str]:
    """How a tiered and a fleet sweep start: the trace, the geometry, the working set, the ``setup`` lines, a table
    per policy (``rows_of(policy)``), the ``key`` to its columns, and what stalled.

    With ``--servers`` above 1 the trace and the working set are each server's.
    """
    per_server = args.servers > 1
    every_server = ", every server's" if per_server else ""
    lines = [
        f"trace     {source.name}: {summary.requests} requests, {summary.prompt_blocks} prompt blocks"
        f" ({summary.prompt_tokens} tokens)" + (f", per server; {args.servers} servers" if per_server else ""),
        f"geometry  {geometry.describe()}",
        f"working set {format_bytes(distinct_blocks * geometry.stored_bytes_per_block)}"
        f" ({distinct_blocks} distinct blocks{every_server})",
        *setup,
    ]
    for policy in args.policies:
        lines += ["", *table(*rows_of(policy))]
    lines += ["", key]
    if stalled:
        lines += ["", *stall_lines(stalled, geometry)]
    return lines


# --------------------------------------------------------------------------
# A host-only sweep


def host_record(args: argparse.Namespace, source: Source, started: float, result: HostSweep) -> dict[str, object]:
    """The JSON record of a host-only sweep."""
    geometry, stored, order, summary = result.geometry, result.stored, result.order, result.summary
    unlimited, unlimited_server, curves = result.unlimited, result.unlimited_server, result.curves
    found, uncompressed = result.found, result.uncompressed
    working_set = result.working_set
    return record_of(
        args,
        source,
        started,
        geometry={
            "model": geometry.name,
            "num_layers": geometry.num_layers,
            "num_kv_heads": geometry.num_kv_heads,
            "head_dim": geometry.head_dim,
            "dtype": geometry.dtype.value,
            "kv_factor": geometry.kv_factor,
            "block_size": geometry.block_size,
            "bytes_per_block": geometry.bytes_per_block,
        },
        compression={
            "kv_compression": stored.compression,
            "group_size": stored.compression_group_size,
            "stored_bytes_per_block": stored.stored_bytes_per_block,
            "ratio": stored.compression_ratio,
            "curves": list(curves),
            "lossy": stored.compression != "none",
        },
        trace={
            **asdict(summary),
            "working_set_bytes": working_set,
            "working_set_gib": working_set / GIB,
            "unlimited_block_hit_rate": unlimited.block_hit_rate,
            "unlimited_token_hit_rate": unlimited.token_hit_rate,
            "unlimited_external_hit_rate": result.unlimited_rate,
            "gpu_share": unlimited_server.gpu_share if unlimited_server is not None else 0.0,
        },
        call_order={"name": order.name, **asdict(order)},
        engine_args=asdict(order.engine_settings(stored.block_size, args.tensor_parallel_size)),
        bandwidth_gbps=args.bandwidth,
        points=[asdict(report) for report in result.reports],
        recommendation=recommendation_record(found, stored),
        **(
            {"recommendation_uncompressed": recommendation_record(uncompressed, geometry)}
            if stored is not geometry
            else {}
        ),
    )


def host_lines(source: Source, result: HostSweep) -> list[str]:
    """What a host-only sweep prints: the trace, the server, a table per compression, admission, the answer."""
    geometry, stored, order, summary = result.geometry, result.stored, result.order, result.summary
    unlimited, unlimited_server, curves = result.unlimited, result.unlimited_server, result.curves
    found, uncompressed = result.found, result.uncompressed
    working_set = result.working_set
    lines = [
        f"trace     {source.name}: {summary.requests} requests, {summary.prompt_blocks} prompt blocks"
        f" ({summary.prompt_tokens} tokens), {summary.output_blocks} output blocks",
        f"geometry  {stored.describe()}",
    ]
    compressed_set = ""
    if stored is not geometry:
        compressed_set = f", {format_bytes(result.stored_working_set)} stored {stored.compression}"
    lines.append(f"working set {format_bytes(working_set)}{compressed_set} ({summary.distinct_blocks} distinct blocks)")
    if isinstance(order, VllmOrder) and unlimited_server is not None:
        lines.append(f"server    {describe_server(order)}")
        lines.append(
            f"with unlimited host memory vLLM would report {percent(result.unlimited_rate)};"
            f" the GPU prefix cache serves {percent(unlimited_server.gpu_share)} of prompt tokens"
        )
    else:
        lines.append(f"with unlimited memory {percent(unlimited.token_hit_rate)} of prompt tokens hit")
    headers = TABLE_HEADERS[order.name]
    for compression, curve in curves.items():
        lines.append("")
        if stored is not geometry:
            lines.append(f"{compression}: {curve_heading(compression, stored)}")
        lines += table(headers, [[COLUMNS[header](report) for header in headers] for report in curve])
    shown = found.point or found.best  # admission depends a little on the capacity: show the chosen point's
    if shown.max_admitted_per_step is not None:
        lines.append("")
        lines.append(
            f"admission: up to {shown.max_admitted_per_step} new requests in one step,"
            f" {shown.mean_admitted_per_step:.1f} on average over the steps that admitted any ({shown.steps} steps,"
            f" {shown.policy.upper()} {format_bytes(shown.capacity_bytes)}); deferred lookups (a block still being"
            f" stored or loaded): {shown.pending_stops}; GPU cache evictions: {shown.gpu_evictions}"
        )
        if shown.preemptions:
            lines.append(
                f"preemptions: {shown.preemptions} running requests were preempted for want of GPU blocks and"
                " started over (vLLM's metrics, and these rates, count their first admission only)"
            )
    lines.append("")
    lines += recommendation_lines(found, order, stored, result.unlimited_rate, max(result.capacities), working_set)
    if stored is not geometry:
        lines.append(uncompressed_line(uncompressed, found, order.name))
    return lines


def host_plot(args: argparse.Namespace, source: Source, result: HostSweep, record: Mapping[str, object]) -> Path | None:
    """Draw the sweep to ``--out``/simulate-<trace>.png; None when matplotlib is missing (said on stderr).

    OSError when the plot cannot be written.
    """
    geometry, stored, order, summary = result.geometry, result.stored, result.order, result.summary
    png_path: Path = args.out / f"simulate-{source.name}.png"
    title = (
        f"{source.name} trace, {summary.requests} requests, {geometry.name}"
        f" ({format_bytes(geometry.bytes_per_block)}/block)"
    )
    if isinstance(order, VllmOrder) and order.gpu_blocks is not None:
        title += f", {order.gpu_blocks} GPU blocks"
    if stored is not geometry:
        title += f"; with and without {stored.compression}"
    compressed_fits = result.stored_working_set / GIB if stored is not geometry else None
    try:
        plot(
            png_path,
            result.reports,
            title,
            result.unlimited_rate,
            result.working_set / GIB,
            order.name,
            args.target_hit_rate,
            compressed_fits,
            stamp=plot_stamp(record),
        )
    except ImportError as error:  # matplotlib is optional: vLLM's own environment may not have it
        print(
            f"kvtriton simulate: no plot: {error.name or 'matplotlib'} is not installed"
            " (pip install matplotlib to draw it, --no-plot to skip it)",
            file=sys.stderr,
        )
        return None
    return png_path


# --------------------------------------------------------------------------
# A tiered sweep


def tiered_lines(
    args: argparse.Namespace, source: Source, result: TieredSweep, geometry: ModelGeometry, order: VllmOrder
) -> list[str]:
    """What a tiered sweep prints: the trace, the tiers, a table per policy, the cheapest point's configuration."""
    lines = tier_sweep_lines(
        args,
        source,
        summarize(result.streams[0]),
        geometry,
        result.distinct_blocks,
        [
            f"server    {describe_server(order)}",
            f"tiers     host memory per server, then {tier_heading(args.tier, args.servers)}",
        ],
        lambda policy: tiered_rows([r for r in result.reports if r.policy == policy], args.host_price_ratio),
        "host hit, tier hit: the prompt tokens vLLM queried that each tier served (prompt_tokens_cached_by_source;"
        " they add up to vLLM hit); 1st lookup: vLLM's kv_offload_tiering_chunk_hits/_chunk_queries, which count"
        " what a tier answered each request's first lookup of a chunk (in a burst, before anything is stored)",
        [report for report in result.reports if report.stalled],
    )
    lines.append("")
    lines += tiered_recommendation_lines(result.found, order, geometry, args.servers, args.tensor_parallel_size)
    return lines


def tiered_record(
    args: argparse.Namespace,
    source: Source,
    started: float,
    result: TieredSweep,
    geometry: ModelGeometry,
    order: VllmOrder,
) -> dict[str, object]:
    """The JSON record of a tiered sweep."""
    found = result.found
    return record_of(
        args,
        source,
        started,
        servers=args.servers,
        **tier_record_fields(args, geometry, order, result.distinct_blocks),
        points=[tiered_point_record(report, args.host_price_ratio) for report in result.reports],
        recommendation={
            "target_hit_rate": found.target,
            "reached": found.point is not None,
            "point": tiered_point_record(found.point, args.host_price_ratio) if found.point is not None else None,
            "kv_connector_extra_config": found.extra_config,
        },
    )
