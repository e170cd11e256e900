"""`kvtriton simulate`: how many cache hits a given amount of host memory buys, for a trace.

Replays a request trace (a built-in synthetic workload or a JSON-lines file)
through ``CPUOffloadingManager`` for a sweep of capacities and each eviction
policy, calling the manager the way a serving engine does, and reports hit
rates, bytes moved, evictions and refused stores per point. Pure scheduler
side: no tensors, no torch, so a sweep takes seconds. The replay loop
(:mod:`kvtriton.tools.replay`) is also what ``bench/manager.py`` times, for
kvtriton's manager and vLLM's.

The simulation models the host tier alone, as if the GPU prefix cache held
nothing: every prompt block is looked up in host memory. A real engine serves
its GPU prefix-cache hits first, so the host tier's own hit rate is lower,
while the combined hit rate is at least what is reported here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar, cast

from kvtriton.tools.geometry import GIB, PRESETS, ModelGeometry, format_bytes, parse_capacity, parse_dtype
from kvtriton.keys import OffloadKey
from kvtriton.manager import CPUOffloadingManager
from kvtriton.tools.progress import progress
from kvtriton.tools.replay import PreparedRequest, ReplayStats, prepare, replay
from kvtriton.tools.vllm_order import DEFAULT_ARRIVALS, DEFAULT_DECODE_STEPS, vllm_order
from kvtriton.tools.workloads import WORKLOADS, Request, generate, read_trace

__all__ = [
    "CALL_ORDERS",
    "DEFAULT_OUT",
    "CallOrder",
    "PointReport",
    "SweepPoint",
    "TraceSummary",
    "add_arguments",
    "default_capacities",
    "run",
    "summarize",
    "sweep",
]

DEFAULT_OUT = "simulate-results"
DEFAULT_WORKLOAD = "chat"
DEFAULT_MODEL = "llama-3-8b"
DEFAULT_POLICIES = ("lru", "arc")
DEFAULT_BANDWIDTH_GBPS = 25.0
DEFAULT_SWEEP_POINTS = 8


# --------------------------------------------------------------------------
# Sweep


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One (policy, capacity) point of a sweep."""

    policy: str
    capacity_bytes: int
    num_blocks: int
    stats: ReplayStats


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """Facts about a trace that do not depend on capacity."""

    requests: int
    prompt_blocks: int
    output_blocks: int
    prompt_tokens: int
    distinct_blocks: int
    """Distinct blocks stored at least once: the capacity at which nothing is ever evicted."""


def summarize(requests: Sequence[PreparedRequest]) -> TraceSummary:
    distinct: set[OffloadKey] = set()
    for request in requests:
        distinct.update(request.prompt_keys)
        distinct.update(request.output_keys)
    return TraceSummary(
        requests=len(requests),
        prompt_blocks=sum(len(request.prompt_keys) for request in requests),
        output_blocks=sum(len(request.output_keys) for request in requests),
        prompt_tokens=sum(request.prompt_tokens for request in requests),
        distinct_blocks=len(distinct),
    )


def default_capacities(geometry: ModelGeometry, distinct_blocks: int, points: int = DEFAULT_SWEEP_POINTS) -> list[int]:
    """``points`` capacities doubling up to the first power-of-two GiB that holds every distinct block.

    Capacities that hold no whole block are dropped.
    """
    working_set_gib = max(distinct_blocks, 1) * geometry.bytes_per_block / GIB
    top = 2.0 ** math.ceil(math.log2(working_set_gib))
    capacities = [int(top / 2**step * GIB) for step in range(points - 1, -1, -1)]
    return [capacity for capacity in capacities if geometry.blocks_for(capacity) >= 1]


CALL_ORDERS = ("engine", "vllm")
"""``engine``: request by request with ``touch`` (kvtriton.tools.replay); ``vllm``: vLLM 0.33's connector (kvtriton.tools.vllm_order)."""


@dataclass(frozen=True, slots=True)
class CallOrder:
    """How the manager is called: the order, and the knobs of vLLM's step model."""

    name: str = "engine"
    in_flight: int = 1
    """``engine`` order: requests admitted before the oldest completes its loads and stores."""
    arrivals: int = DEFAULT_ARRIVALS
    """``vllm`` order: new requests scheduled per engine step."""
    decode_steps: int = DEFAULT_DECODE_STEPS
    """``vllm`` order: steps from a request's prompt computation to its end."""
    sync_loads: bool = False
    """``vllm`` order: a loading request computes in the step of its load instead of the next."""

    def __post_init__(self) -> None:
        if self.name not in CALL_ORDERS:
            raise ValueError(f"call order must be one of {', '.join(CALL_ORDERS)}, got {self.name!r}")

    def replay(self, requests: Sequence[PreparedRequest], manager: CPUOffloadingManager, block_size: int) -> ReplayStats:
        if self.name == "vllm":
            return vllm_order(
                requests,
                manager,
                block_size=block_size,
                arrivals=self.arrivals,
                decode_steps=self.decode_steps,
                sync_loads=self.sync_loads,
            )
        return replay(requests, manager, block_size=block_size, in_flight=self.in_flight)


def sweep(
    requests: Sequence[PreparedRequest],
    geometry: ModelGeometry,
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    in_flight: int = 1,
    show_progress: bool = True,
    order: CallOrder | None = None,
) -> list[SweepPoint]:
    """Replay ``requests`` once per (policy, capacity), each on a fresh manager.

    ``order`` picks the call order (default: the engine order with ``in_flight``).
    """
    call_order = order if order is not None else CallOrder(in_flight=in_flight)
    for capacity in capacities:
        if geometry.blocks_for(capacity) < 1:
            raise ValueError(
                f"capacity {format_bytes(capacity)} holds no block of {format_bytes(geometry.bytes_per_block)}"
            )
    grid = [(policy, capacity) for policy in policies for capacity in capacities]
    points: list[SweepPoint] = []
    for policy, capacity in progress(grid, len(grid), "simulate", enabled=show_progress):
        num_blocks = geometry.blocks_for(capacity)
        manager = CPUOffloadingManager(num_blocks, cache_policy=policy)
        stats = call_order.replay(requests, manager, geometry.block_size)
        points.append(SweepPoint(policy, capacity, num_blocks, stats))
    return points


# --------------------------------------------------------------------------
# Command line


NumberT = TypeVar("NumberT", int, float)


def _number(parse: Callable[[str], NumberT], what: str, valid: Callable[[NumberT], bool]) -> Callable[[str], NumberT]:
    """An argparse ``type``: ``text`` parsed by ``parse`` and accepted by ``valid``, else an error naming ``what``."""

    def convert(text: str) -> NumberT:
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not valid(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return convert


_positive_int = _number(int, "a positive integer", lambda value: value >= 1)
_non_negative_int = _number(int, "an integer >= 0", lambda value: value >= 0)
_positive_float = _number(float, "a positive number", lambda value: math.isfinite(value) and value > 0)


def _listed(text: str, what: str) -> list[str]:
    """The non-blank items of a comma-separated list, stripped; an error when there are none."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}")
    return items


def _capacities(text: str) -> list[int]:
    try:
        return sorted({parse_capacity(item) for item in _listed(text, "sizes")})
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _policies(text: str) -> list[str]:
    names = [name.lower() for name in _listed(text, "policies")]
    for name in names:
        try:
            CPUOffloadingManager(1, cache_policy=name)
        except ValueError as error:  # the manager's message lists the valid names
            raise argparse.ArgumentTypeError(str(error)) from None
    return list(dict.fromkeys(names))


def _param(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value.strip()


def _dtype(text: str) -> str:
    try:
        return parse_dtype(text).value
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _workloads_epilog() -> str:
    lines = ["built-in workloads and their --param names (defaults):"]
    for workload in WORKLOADS.values():
        lines.append(f"  {workload.name}: {workload.summary}")
        lines.append("    " + ", ".join(f"{name}={value}" for name, value in workload.parameters().items()))
    lines.append("")
    lines.append("model presets (bf16, 16 tokens per block):")
    for geometry in PRESETS.values():
        lines.append(f"  {geometry.name}: {format_bytes(geometry.bytes_per_block)} per block")
    lines.append("")
    lines.append(
        "trace files: JSON lines, one request per line: "
        '{"id": "r1", "blocks": ["h1", "h2", ...], "tokens": 40, "output_blocks": ["h3"]}; '
        "only blocks is required (block hashes: strings or non-negative integers, chained like "
        "vLLM's, so equal hashes mean equal prefixes)."
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (__doc__ or "").split("\n\n")[0].removeprefix("`kvtriton simulate`: ")
    parser.epilog = _workloads_epilog()
    source = parser.add_argument_group("trace")
    choice = source.add_mutually_exclusive_group()
    choice.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default=DEFAULT_WORKLOAD,
        help=f"built-in synthetic workload to replay (default: {DEFAULT_WORKLOAD})",
    )
    choice.add_argument("--trace", type=Path, metavar="FILE", help="replay this JSON-lines trace instead of a workload")
    source.add_argument(
        "--requests",
        type=_positive_int,
        metavar="N",
        help="number of requests the workload generates (default: the workload's, listed below)",
    )
    source.add_argument("--seed", type=_non_negative_int, default=0, help="workload random seed (default: 0)")
    source.add_argument(
        "--param",
        type=_param,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one workload parameter (repeatable; names listed below)",
    )
    model = parser.add_argument_group("model geometry (turns blocks into bytes)")
    model.add_argument(
        "--model",
        choices=list(PRESETS),
        default=DEFAULT_MODEL,
        help=f"preset KV shape; the flags below override its fields (default: {DEFAULT_MODEL})",
    )
    model.add_argument("--layers", type=_positive_int, metavar="N", help="number of layers (default: the preset's)")
    model.add_argument("--kv-heads", type=_positive_int, metavar="N", help="KV heads per layer (default: the preset's)")
    model.add_argument("--head-dim", type=_positive_int, metavar="N", help="head dimension (default: the preset's)")
    model.add_argument("--dtype", type=_dtype, help="KV cache dtype: bf16, fp16, fp32, fp8 (default: the preset's, bf16)")
    model.add_argument(
        "--block-size",
        type=_positive_int,
        metavar="TOKENS",
        help="tokens per offloaded block (default: the preset's, 16)",
    )
    sim = parser.add_argument_group("sweep")
    sim.add_argument(
        "--capacities",
        type=_capacities,
        metavar="LIST",
        help="host memory sizes to try, comma-separated; bare numbers are GiB, units KiB/MiB/GiB/TiB"
        f" or KB/MB/GB/TB accepted (default: {DEFAULT_SWEEP_POINTS} sizes doubling up to the first"
        " power-of-two GiB that holds the whole trace)",
    )
    sim.add_argument(
        "--policies",
        type=_policies,
        default=list(DEFAULT_POLICIES),
        metavar="LIST",
        help=f"eviction policies to compare, comma-separated (default: {','.join(DEFAULT_POLICIES)})",
    )
    sim.add_argument(
        "--in-flight",
        type=_positive_int,
        default=1,
        metavar="N",
        help="requests admitted before the oldest completes its loads and stores (default: 1)",
    )
    sim.add_argument(
        "--call-order",
        choices=list(CALL_ORDERS),
        default="engine",
        help="how the manager is called: 'engine' request by request with touch (kvtriton's API),"
        " 'vllm' step by step as vLLM 0.33's OffloadingConnector calls it, no touch (default: engine)",
    )
    sim.add_argument(
        "--arrivals",
        type=_positive_int,
        default=DEFAULT_ARRIVALS,
        metavar="N",
        help=f"--call-order vllm: new requests scheduled per engine step (default: {DEFAULT_ARRIVALS})",
    )
    sim.add_argument(
        "--decode-steps",
        type=_positive_int,
        default=DEFAULT_DECODE_STEPS,
        metavar="N",
        help=f"--call-order vllm: steps from a request's prompt to its end (default: {DEFAULT_DECODE_STEPS})",
    )
    sim.add_argument(
        "--sync-loads",
        action="store_true",
        help="--call-order vllm: a request that loads computes in the step of its load"
        " (vLLM with sync_load_budget_bytes) instead of the next step (vLLM's default)",
    )
    sim.add_argument(
        "--bandwidth",
        type=_positive_float,
        default=DEFAULT_BANDWIDTH_GBPS,
        metavar="GB/S",
        help="host<->GPU copy bandwidth for the transfer-time estimate, in GB/s"
        f" (default: {DEFAULT_BANDWIDTH_GBPS:g}, PCIe 4.0 x16 in practice)",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT),
        metavar="DIR",
        help=f"folder for simulate-<trace>.json and .png, created if missing (default: ./{DEFAULT_OUT})",
    )
    out.add_argument("--json", action="store_true", help="print the JSON record on stdout instead of the table")
    out.add_argument("--no-plot", action="store_true", help="skip the PNG plot (and the matplotlib import)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


@dataclass(frozen=True, slots=True)
class _Source:
    name: str
    description: dict[str, object] = field(default_factory=dict[str, object])


def _geometry(args: argparse.Namespace) -> ModelGeometry:
    preset = PRESETS[args.model]
    return ModelGeometry(
        name=preset.name,
        num_layers=args.layers or preset.num_layers,
        num_kv_heads=args.kv_heads or preset.num_kv_heads,
        head_dim=args.head_dim or preset.head_dim,
        dtype=parse_dtype(args.dtype) if args.dtype else preset.dtype,
        block_size=args.block_size or preset.block_size,
        kv_factor=preset.kv_factor,
    )


def _load_trace(args: argparse.Namespace, block_size: int) -> tuple[_Source, list[Request]]:
    if args.trace is not None:
        path: Path = args.trace
        if not path.exists():
            raise ValueError(f"--trace: no such file: {path}")
        if path.is_dir():
            raise ValueError(f"--trace: {path} is a directory, not a JSON-lines trace file")
        if args.requests is not None or args.param:
            raise ValueError("--requests and --param shape built-in workloads; they do not apply to --trace")
        # Not is_file(): a pipe (`--trace <(zcat trace.jsonl.gz)`) is a fine trace too.
        try:
            requests = read_trace(path, block_size=block_size)
        except OSError as error:
            raise ValueError(f"--trace: cannot read {path}: {error.strerror or error}") from None
        return _Source(path.stem, {"trace": str(path)}), requests
    overrides: dict[str, str] = dict(args.param)
    if args.requests is not None:
        if "requests" in overrides:
            raise ValueError(
                f"--requests {args.requests} and --param requests={overrides['requests']} both set the request"
                " count; give one"
            )
        overrides["requests"] = str(args.requests)
    workload = WORKLOADS[args.workload]
    try:
        params = workload.params(overrides)
    except ValueError as error:
        raise ValueError(f"--param: {error}") from None
    description: dict[str, object] = {"workload": workload.name, "seed": args.seed, "params": asdict(params)}
    return _Source(workload.name, description), generate(
        workload.name, seed=args.seed, block_size=block_size, overrides=overrides
    )


def _percent(rate: float) -> str:
    return f"{100 * rate:.1f}%"


def _gib(size: float) -> str:
    gib = size / GIB
    return f"{gib:.3g}" if gib < 1000 else f"{gib:,.0f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max([len(header), *(len(row[i]) for row in rows)]) for i, header in enumerate(headers)]
    lines = ["  ".join(header.rjust(width) for header, width in zip(headers, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(value.rjust(width) for value, width in zip(row, widths)) for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class PointReport:
    """One sweep point as reported: the replay counts turned into rates, bytes and seconds."""

    policy: str
    capacity_gib: float
    capacity_bytes: int
    num_blocks: int
    block_hit_rate: float
    token_hit_rate: float
    hit_blocks: int
    hit_tokens: int
    bytes_loaded: int
    bytes_stored: int
    blocks_stored: int
    evictions: int
    refused_stores: int
    refused_blocks: int
    pending_stops: int
    load_seconds: float
    store_seconds: float

    @classmethod
    def of(cls, point: SweepPoint, geometry: ModelGeometry, bandwidth_gbps: float) -> PointReport:
        stats = point.stats
        bytes_loaded = stats.hit_blocks * geometry.bytes_per_block
        bytes_stored = stats.blocks_stored * geometry.bytes_per_block
        return cls(
            policy=point.policy,
            capacity_gib=point.capacity_bytes / GIB,
            capacity_bytes=point.capacity_bytes,
            num_blocks=point.num_blocks,
            block_hit_rate=stats.block_hit_rate,
            token_hit_rate=stats.token_hit_rate,
            hit_blocks=stats.hit_blocks,
            hit_tokens=stats.hit_tokens,
            bytes_loaded=bytes_loaded,
            bytes_stored=bytes_stored,
            blocks_stored=stats.blocks_stored,
            evictions=stats.evictions,
            refused_stores=stats.refused_stores,
            refused_blocks=stats.refused_blocks,
            pending_stops=stats.pending_stops,
            load_seconds=bytes_loaded / (bandwidth_gbps * 1e9),
            store_seconds=bytes_stored / (bandwidth_gbps * 1e9),
        )


class _Axes(Protocol):
    """The few matplotlib Axes methods the plot uses, typed (matplotlib's stubs leave ``**kwargs`` unknown)."""

    def plot(self, x: Sequence[float], y: Sequence[float], *, marker: str, label: str) -> object: ...
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
    def savefig(self, fname: Path, *, dpi: int) -> None: ...


def _plot(path: Path, reports: Sequence[PointReport], title: str, ceiling: float, working_set_gib: float) -> None:
    """Token hit rate against capacity, one line per policy, with the unlimited-memory ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw_figure, raw_axes = plt.subplots(figsize=(7.5, 4.5))
    figure, axes = cast(_Figure, raw_figure), cast(_Axes, raw_axes)
    for policy in dict.fromkeys(report.policy for report in reports):
        mine = [report for report in reports if report.policy == policy]
        axes.plot(
            [report.capacity_gib for report in mine],
            [100 * report.token_hit_rate for report in mine],
            marker="o",
            label=policy.upper(),
        )
    axes.axhline(100 * ceiling, color="grey", linestyle="--", linewidth=1, label="unlimited memory")
    axes.axvline(working_set_gib, color="grey", linestyle=":", linewidth=1, label="whole trace fits")
    axes.set_xscale("log", base=2)
    ticks = sorted({report.capacity_gib for report in reports})
    axes.set_xticks(ticks, labels=[f"{tick:.3g}" for tick in ticks])
    axes.minorticks_off()
    axes.set_xlabel("host memory for the KV cache (GiB, log scale)")
    axes.set_ylabel("prompt tokens served from host memory (%)")
    axes.set_ylim(0, 100)
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(raw_figure)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        geometry = _geometry(args)
        source, requests = _load_trace(args, geometry.block_size)
    except (ValueError, OSError) as error:
        print(f"kvtriton simulate: error: {error}", file=sys.stderr)
        return 2
    prepared = prepare(requests)
    summary = summarize(prepared)
    capacities: list[int] = args.capacities or default_capacities(geometry, summary.distinct_blocks)
    too_small = [capacity for capacity in capacities if geometry.blocks_for(capacity) < 1]
    if too_small:
        print(
            f"kvtriton simulate: error: --capacities: {format_bytes(too_small[0])} holds no block of"
            f" {format_bytes(geometry.bytes_per_block)}",
            file=sys.stderr,
        )
        return 2
    show_progress = not args.no_progress
    order = CallOrder(
        name=args.call_order,
        in_flight=args.in_flight,
        arrivals=args.arrivals,
        decode_steps=args.decode_steps,
        sync_loads=args.sync_loads,
    )
    # The ceiling: capacity for every distinct block, so nothing is ever evicted.
    unlimited = order.replay(
        prepared, CPUOffloadingManager(max(summary.distinct_blocks, 1), cache_policy="lru"), geometry.block_size
    )
    points = sweep(prepared, geometry, capacities, args.policies, show_progress=show_progress, order=order)
    reports = [PointReport.of(point, geometry, args.bandwidth) for point in points]
    working_set = summary.distinct_blocks * geometry.bytes_per_block
    record: dict[str, object] = {
        "command": "kvtriton simulate",
        "argv": sys.argv[1:],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "source": {"name": source.name, **source.description},
        "geometry": {
            "model": geometry.name,
            "num_layers": geometry.num_layers,
            "num_kv_heads": geometry.num_kv_heads,
            "head_dim": geometry.head_dim,
            "dtype": geometry.dtype.value,
            "kv_factor": geometry.kv_factor,
            "block_size": geometry.block_size,
            "bytes_per_block": geometry.bytes_per_block,
        },
        "trace": {
            **asdict(summary),
            "working_set_bytes": working_set,
            "working_set_gib": working_set / GIB,
            "unlimited_block_hit_rate": unlimited.block_hit_rate,
            "unlimited_token_hit_rate": unlimited.token_hit_rate,
        },
        "in_flight": args.in_flight,
        "call_order": asdict(order),
        "bandwidth_gbps": args.bandwidth,
        "points": [asdict(report) for report in reports],
        "elapsed_seconds": time.perf_counter() - started,
    }
    out_dir: Path = args.out
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path = out_dir / f"simulate-{source.name}.json"
        json_path.write_text(json.dumps(record, indent=2) + "\n")
        png_path = out_dir / f"simulate-{source.name}.png"
        if not args.no_plot:
            title = f"{source.name} trace, {summary.requests} requests, {geometry.name} ({format_bytes(geometry.bytes_per_block)}/block)"
            _plot(png_path, reports, title, unlimited.token_hit_rate, working_set / GIB)
    except OSError as error:
        print(f"kvtriton simulate: error: --out {out_dir}: cannot write results: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    print(f"trace     {source.name}: {summary.requests} requests, {summary.prompt_blocks} prompt blocks"
          f" ({summary.prompt_tokens} tokens), {summary.output_blocks} output blocks")
    print(f"geometry  {geometry.describe()}")
    print(f"working set {format_bytes(working_set)} ({summary.distinct_blocks} distinct blocks);"
          f" with unlimited memory {_percent(unlimited.token_hit_rate)} of prompt tokens hit")
    print()
    headers = ["policy", "GiB", "blocks", "hit blk", "hit tok", "stored GiB", "loaded GiB",
               "evictions", "refused", "load s", "store s"]  # fmt: skip
    rows = [
        [
            report.policy,
            _gib(report.capacity_bytes),
            str(report.num_blocks),
            _percent(report.block_hit_rate),
            _percent(report.token_hit_rate),
            _gib(report.bytes_stored),
            _gib(report.bytes_loaded),
            str(report.evictions),
            str(report.refused_stores),
            f"{report.load_seconds:.2f}",
            f"{report.store_seconds:.2f}",
        ]
        for report in reports
    ]
    print(_table(headers, rows))
    print()
    print(f"wrote {json_path}" + ("" if args.no_plot else f" and {png_path}"))
    return 0
