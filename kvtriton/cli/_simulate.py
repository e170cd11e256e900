"""`kvtriton simulate`: how many cache hits a given amount of host memory buys, for a trace.

Replays a request trace (a built-in synthetic workload or a JSON-lines file)
through ``CPUOffloadingManager`` for a sweep of capacities and each eviction
policy, calling the manager the way a serving engine does, and reports hit
rates, bytes moved, evictions and refused stores per point, then the vLLM
configuration of the smallest size that reaches ``--target-hit-rate``. Pure
scheduler side: no tensors, no torch, so a sweep takes seconds. The replay
loops (:mod:`kvtriton.sim._replay`, :mod:`kvtriton.sim._vllm_order`) are
also what ``bench/manager.py`` times, for kvtriton's manager and vLLM's.

With ``--call-order vllm`` (implied by ``--gpu-blocks``, ``--max-num-seqs``
and ``--sequential``) the trace runs through a model of a vLLM 0.33 server
(:mod:`kvtriton.sim._vllm_server`): its admission, its own GPU prefix cache
in front of the offload tier, and its asynchronous loads and stores, so the
hit rate reported is the one vLLM's metrics show
(``external_prefix_cache_hits / external_prefix_cache_queries``).

With ``--compression fp8-e4m3`` (lossy) every size is swept twice: with
uncompressed rows and with fp8-e4m3 rows, whose bytes per block come from the
compression format itself (:meth:`ModelGeometry.with_compression`, the only
step that imports torch), so a size holds about 1.9x the blocks and every
copy moves about 0.52x the bytes (bf16). The table, the JSON and the plot
show both; the recommendation is the compressed one, its
``kv_connector_extra_config`` carrying ``kvtriton_kv_compression``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol, TypeVar, cast

from kvtriton.cli._main import add_choice_argument, command_error
from kvtriton.cli._progress import ProgressBar, progress
from kvtriton.manager import CPUOffloadingManager
from kvtriton.manager.policies import policy_names
from kvtriton.sim import (
    CALL_ORDER_ALIASES,
    CALL_ORDERS,
    COMPRESSION_EXTRA_CONFIG_KEY,
    DEFAULT_ARRIVALS,
    DEFAULT_DECODE_STEPS,
    DEFAULT_HOST_PRICE_RATIO,
    DEFAULT_LOAD_STEPS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_STORE_STEPS,
    DEFAULT_SWEEP_POINTS,
    GIB,
    MOONCAKE_EVICTION_RATIO,
    MOONCAKE_HIGH_WATERMARK,
    PRESETS,
    WORKLOADS,
    CallOrder,
    KvtritonOrder,
    ModelGeometry,
    PointReport,
    Recommendation,
    Request,
    TieredRecommendation,
    TieredReport,
    TierSpec,
    VllmOrder,
    default_capacities,
    format_bytes,
    generate,
    parse_dtype,
    parse_tier,
    prepare,
    read_trace,
    recommend,
    recommend_tiered,
    size_argument,
    summarize,
    sweep,
    sweep_requests,
    tiered_sweep,
)

DEFAULT_OUT = "simulate-results"
DEFAULT_WORKLOAD = "chat"
DEFAULT_MODEL = "llama-3-8b"
DEFAULT_POLICIES = ("lru", "arc")
DEFAULT_BANDWIDTH_GBPS = 25.0
DEFAULT_TARGET_HIT_RATE = 0.5
COMPRESSIONS = ("none", "fp8-e4m3")
"""``--compression`` values: kvtriton's slab row formats (kvtriton.kernels._compression.KVCompression)."""


# --------------------------------------------------------------------------
# Command line


NumberT = TypeVar("NumberT", int, float)
ParsedT = TypeVar("ParsedT")
GridT = TypeVar("GridT")


def _parsed_by(parse: Callable[[str], ParsedT]) -> Callable[[str], ParsedT]:
    """An argparse ``type``: ``text`` parsed by ``parse``, its ValueError shown as the flag's error, unchanged."""

    def convert(text: str) -> ParsedT:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


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
_dtype = _parsed_by(lambda text: parse_dtype(text).value)
_tier = _parsed_by(parse_tier)


def _listed(text: str, what: str) -> list[str]:
    """The items of a comma-separated list, stripped; an error for an empty list or an empty item."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}")
    if not all(items):
        position = items.index("") + 1
        raise argparse.ArgumentTypeError(f"item {position} of {text!r} is empty: give a comma-separated list of {what}")
    return items


def _capacities(text: str) -> list[int]:
    sizes: dict[int, str] = {}
    for item in _listed(text, "sizes"):
        if item.startswith("-"):
            raise argparse.ArgumentTypeError(f"sizes must be positive, got {item!r}")
        size = size_argument(item)
        if size in sizes:
            raise argparse.ArgumentTypeError(
                f"{sizes[size]!r} and {item!r} are the same size ({format_bytes(size)}): give each size once"
            )
        sizes[size] = item
    return sorted(sizes)


def _policies(text: str) -> list[str]:
    """Eviction policy names, in any case, each once."""
    names: list[str] = []
    valid = policy_names()
    for item in _listed(text, "policies"):
        name = item.lower()
        if name not in valid:
            raise argparse.ArgumentTypeError(f"unknown policy {item!r} in {text!r}: expected {', '.join(valid)}")
        if name in names:
            raise argparse.ArgumentTypeError(f"policy {item!r} is listed twice in {text!r}: give each policy once")
        names.append(name)
    return names


def _target_rate(text: str) -> float:
    """A hit rate: a fraction in (0, 1] (``0.5``) or a percentage (``50%``)."""
    stripped = text.strip()
    percent = stripped.endswith("%")
    try:
        value = float(stripped.removesuffix("%"))
    except ValueError:
        value = math.nan
    if percent:
        value /= 100
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(
            f"expected a hit rate as a fraction in (0, 1] or a percentage, e.g. 0.5 or 50%, got {text!r}"
        )
    return value


def _param(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value.strip()


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
        '{"id": "r1", "blocks": ["h1", "h2", "h3"], "tokens": 56, "output_blocks": ["h4"]}; '
        "only blocks is required (block hashes: strings or non-negative integers, chained like "
        "vLLM's, so equal hashes mean equal prefixes); tokens, the prompt length, must fit the full "
        "blocks (3 blocks of 16 tokens: 48..63); a timestamp field is accepted and ignored (requests arrive in "
        "line order); a gzip-compressed file is read as such."
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (__doc__ or "").split("\n\n")[0].removeprefix("`kvtriton simulate`: ")
    parser.epilog = _workloads_epilog()
    _add_trace_arguments(parser)
    _add_geometry_arguments(parser)
    sweep_group = _add_sweep_arguments(parser)
    _add_server_arguments(parser)
    _add_answer_arguments(sweep_group)
    _add_tier_arguments(parser)
    _add_output_arguments(parser)


def _add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("trace")
    choice = source.add_mutually_exclusive_group()
    add_choice_argument(
        choice,
        "--workload",
        list(WORKLOADS),
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


def _add_geometry_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model geometry (turns blocks into bytes)")
    add_choice_argument(
        model,
        "--model",
        list(PRESETS),
        default=DEFAULT_MODEL,
        help=f"preset KV shape; the flags below override its fields (default: {DEFAULT_MODEL})",
    )
    model.add_argument("--layers", type=_positive_int, metavar="N", help="number of layers (default: the preset's)")
    model.add_argument("--kv-heads", type=_positive_int, metavar="N", help="KV heads per layer (default: the preset's)")
    model.add_argument("--head-dim", type=_positive_int, metavar="N", help="head dimension (default: the preset's)")
    model.add_argument(
        "--dtype", type=_dtype, help="KV cache dtype: bf16, fp16, fp32, fp8 (default: the preset's, bf16)"
    )
    model.add_argument(
        "--block-size",
        type=_positive_int,
        metavar="TOKENS",
        help="tokens per offloaded block (default: the preset's, 16)",
    )
    add_choice_argument(
        model,
        "--compression",
        COMPRESSIONS,
        default="none",
        help="host memory row format: with fp8-e4m3 (lossy: fp8 codes plus one fp32 scale per group) every size is"
        " swept with and without it, the compressed rows holding ~1.9x the blocks and moving ~0.52x the bytes"
        " (bf16); the recommendation is then the compressed one (default: none)",
    )
    model.add_argument(
        "--group-size",
        type=_positive_int,
        metavar="N",
        help="--compression fp8-e4m3: elements per fp8 scale (default: the head dimension)",
    )


def _add_sweep_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:  # pyright: ignore[reportPrivateUsage] -- argparse names its group type only privately
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
        "--call-order",
        type=_call_order_name,
        choices=list(CALL_ORDERS),
        help="how the manager is called: 'kvtriton' request by request with touch (kvtriton's API; 'engine',"
        " its earlier name, is accepted), 'vllm' step by step through a model of a vLLM 0.33 server, as its"
        " OffloadingConnector calls it (default: vllm when --gpu-blocks, --max-num-seqs or --sequential is"
        " given, else kvtriton)",
    )
    sim.add_argument(
        "--in-flight",
        type=_positive_int,
        metavar="N",
        help="--call-order kvtriton: requests admitted before the oldest completes its loads and stores (default: 1)",
    )
    return sim


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group(
        "vLLM server model (--call-order vllm)",
        "What the vLLM server is started with. Arrivals: all requests at once (with --max-num-seqs),"
        " --arrivals N per step, or --sequential.",
    )
    server.add_argument(
        "--gpu-blocks",
        type=_number(int, "an integer >= 2", lambda value: value >= 2),
        metavar="N",
        help="the server's own GPU KV cache in blocks of --block-size tokens (vLLM's num_gpu_blocks), its prefix"
        " cache on, in front of the offload tier (default: prefix caching off)",
    )
    server.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        metavar="N",
        help="vLLM's --max-num-seqs: requests running at once; requests waiting for a load do not count,"
        " so a burst of them is admitted (default: no limit)",
    )
    server.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        metavar="N",
        help=f"vLLM's --max-num-batched-tokens: tokens computed per step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    arrival = server.add_mutually_exclusive_group()
    arrival.add_argument(
        "--arrivals",
        type=_positive_int,
        metavar="N",
        help=f"new requests arriving per scheduler step (default: {DEFAULT_ARRIVALS} when neither --max-num-seqs"
        " nor --sequential is given, else all requests at once)",
    )
    arrival.add_argument(
        "--sequential",
        action="store_true",
        help="one request at a time: each arrives the step after the previous one finished, whose stores may"
        " still be in flight (a client that waits for every answer)",
    )
    server.add_argument(
        "--decode-steps",
        type=_positive_int,
        metavar="N",
        help=f"tokens each request generates, vLLM's max_tokens (default: {DEFAULT_DECODE_STEPS})",
    )
    server.add_argument(
        "--load-steps",
        type=_positive_int,
        metavar="N",
        help="a load is reported done at the end of the N-th step counted from the one that schedules it"
        f" (default: {DEFAULT_LOAD_STEPS}: within its own step)",
    )
    server.add_argument(
        "--store-steps",
        type=_positive_int,
        metavar="N",
        help="a store prepared in one step completes at the end of the N-th step after it; until then its"
        f" blocks look up as pending (default: {DEFAULT_STORE_STEPS}: submitted the next step, done the one after)",
    )
    server.add_argument(
        "--sync-loads",
        action="store_true",
        help="a request that loads computes in the step of its load"
        " (vLLM with sync_load_budget_bytes) instead of the next step (vLLM's default)",
    )
    server.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="vLLM's --tensor-parallel-size: the host memory is split over N worker processes, each pinning"
        " its share (for the pinned-memory advice; default: 1)",
    )


def _add_answer_arguments(sim: argparse._ArgumentGroup) -> None:  # pyright: ignore[reportPrivateUsage] -- argparse names its group type only privately
    sim.add_argument(
        "--bandwidth",
        type=_positive_float,
        default=DEFAULT_BANDWIDTH_GBPS,
        metavar="GB/S",
        help="host<->GPU copy bandwidth for the transfer-time estimate, in GB/s"
        f" (default: {DEFAULT_BANDWIDTH_GBPS:g}, PCIe 4.0 x16 in practice)",
    )
    sim.add_argument(
        "--target-hit-rate",
        type=_target_rate,
        default=DEFAULT_TARGET_HIT_RATE,
        metavar="RATE",
        help="print the vLLM configuration of the smallest size whose hit rate reaches RATE, a fraction or a"
        " percentage (the rate vLLM reports with --call-order vllm, the token hit rate otherwise;"
        f" default: {DEFAULT_TARGET_HIT_RATE:g})",
    )


def _add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    tiers = parser.add_argument_group(
        "second tier (vLLM's tiered offloading behind the host tier; implies --call-order vllm)",
        "Stores cascade from host memory to the tier, a chunk found only there is promoted back first (the request"
        " waits for it). Each (policy, host size, tier size) point is printed with both tiers' rates.",
    )
    tiers.add_argument(
        "--tier",
        type=_tier,
        metavar="fs|mooncake[:SIZE]",
        help="the second tier: 'fs' (vLLM's, a file per chunk, never evicts: the planner reports the disk it fills),"
        " 'mooncake:SIZE' (a Mooncake Store pool of SIZE, evicting as its master does), or 'mooncake' to sweep"
        " the pool's size (--tier-sizes)",
    )
    tiers.add_argument(
        "--tier-sizes",
        type=_capacities,
        metavar="LIST",
        help="--tier mooncake: pool sizes to sweep, comma-separated, units as --capacities (default: 4 sizes"
        " doubling up to the first power-of-two GiB that holds the whole trace)",
    )
    tiers.add_argument(
        "--host-price-ratio",
        type=_positive_float,
        default=DEFAULT_HOST_PRICE_RATIO,
        metavar="R",
        help="what a GiB of host memory costs in GiB of the tier, for --target-hit-rate's cheapest point"
        f" (default: {DEFAULT_HOST_PRICE_RATIO:g}; docs/simulate.md says why)",
    )
    tiers.add_argument(
        "--servers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="N servers share the tier (one Mooncake pool, or one fs root): each has its own host tier of each"
        " size and its own request stream (the workload with seed --seed, stream 0..N-1: the popular prompts"
        " are common, the requests each server's own); built-in workloads only (default: 1)",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
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
    """The preset with the flags' overrides; named after the preset only while its shape is the preset's."""
    preset = PRESETS[args.model]
    shape: dict[str, int] = {
        "num_layers": args.layers or preset.num_layers,
        "num_kv_heads": args.kv_heads or preset.num_kv_heads,
        "head_dim": args.head_dim or preset.head_dim,
    }
    changed = [name for name, value in shape.items() if value != getattr(preset, name)]
    if not changed:
        name = preset.name
    elif len(changed) == len(shape):
        name = "custom"
    else:
        name = f"{preset.name} (modified)"
    dtype = parse_dtype(args.dtype) if args.dtype else preset.dtype
    return replace(preset, name=name, dtype=dtype, block_size=args.block_size or preset.block_size, **shape)


def _call_order_name(text: str) -> str:
    """``--call-order``'s value in any case, its earlier documented name mapped to today's."""
    name = text.strip().lower()
    name = CALL_ORDER_ALIASES.get(name, name)
    if name not in CALL_ORDERS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(CALL_ORDERS)}, got {text!r}")
    return name


def _call_order(args: argparse.Namespace) -> CallOrder:
    """The call order the flags ask for; ValueError naming the flag that does not apply."""
    server_flags = _given_flags(
        ("--gpu-blocks", args.gpu_blocks is not None),
        ("--max-num-seqs", args.max_num_seqs is not None),
        ("--sequential", args.sequential),
        ("--tier", args.tier is not None),
    )
    # The server model's other knobs: given alone they do not select vLLM's order (each has a default there).
    model_flags = _given_flags(
        ("--arrivals", args.arrivals is not None),
        ("--max-num-batched-tokens", args.max_num_batched_tokens is not None),
        ("--decode-steps", args.decode_steps is not None),
        ("--load-steps", args.load_steps is not None),
        ("--store-steps", args.store_steps is not None),
        ("--sync-loads", args.sync_loads),
    )
    name: str = args.call_order or ("vllm" if server_flags else "kvtriton")
    if name == "kvtriton":
        if args.tier is not None:
            raise ValueError("--tier models vLLM's tiered offloading: it applies to --call-order vllm, not kvtriton")
        misplaced = server_flags + model_flags
        if misplaced:
            # Without --call-order, kvtriton's order is only the default: say which flags select vLLM's.
            why = (
                ", not kvtriton"
                if args.call_order is not None
                else ", and without --gpu-blocks, --max-num-seqs or --sequential the order is kvtriton; add"
                " --call-order vllm (or the server's --gpu-blocks and --max-num-seqs)"
            )
            raise ValueError(f"{misplaced[0]} models the vLLM server: it applies to --call-order vllm{why}")
        return KvtritonOrder(in_flight=args.in_flight or 1)
    if args.in_flight is not None:
        raise ValueError(
            "--in-flight applies to --call-order kvtriton; vLLM's order admits with --max-num-seqs, --arrivals or --sequential"
        )
    arrivals: int | None = args.arrivals
    if arrivals is None and args.max_num_seqs is None and not args.sequential:
        arrivals = DEFAULT_ARRIVALS
    return VllmOrder(
        arrivals=arrivals,
        sequential=args.sequential,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=_given(args.max_num_batched_tokens, DEFAULT_MAX_NUM_BATCHED_TOKENS),
        gpu_blocks=args.gpu_blocks,
        decode_steps=_given(args.decode_steps, DEFAULT_DECODE_STEPS),
        load_steps=_given(args.load_steps, DEFAULT_LOAD_STEPS),
        store_steps=_given(args.store_steps, DEFAULT_STORE_STEPS),
        sync_loads=args.sync_loads,
    )


def _given_flags(*flags: tuple[str, bool]) -> list[str]:
    """The names of the ``(flag, given)`` pairs whose flag was given, in order."""
    return [flag for flag, given in flags if given]


def _given(value: int | None, default: int) -> int:
    """A flag's value, or its default when it was not given (None: the flag's own default, so "given" is known)."""
    return default if value is None else value


def _load_trace(args: argparse.Namespace, block_size: int) -> tuple[_Source, list[Request]]:
    if args.trace is not None:
        path: Path = args.trace
        if not path.exists():
            raise ValueError(f"--trace: no such file: {path}")
        if path.is_dir():
            raise ValueError(f"--trace: {path} is a directory, not a JSON-lines trace file")
        if args.requests is not None or args.param:
            raise ValueError("--requests and --param shape built-in workloads; they do not apply to --trace")
        # Not is_file(): a pipe (`--trace <(ssh host cat trace.jsonl)`) is a fine trace too.
        try:
            requests = read_trace(path, block_size=block_size)
        except OSError as error:
            raise ValueError(f"--trace: cannot read {path}: {error.strerror or error}") from None
        stem = Path(path.name.removesuffix(".gz")).stem  # my-trace.jsonl.gz writes simulate-my-trace.json
        return _Source(stem, {"trace": str(path)}), requests
    overrides = _workload_overrides(args)
    workload = WORKLOADS[args.workload]
    try:
        params = workload.params(overrides)
    except ValueError as error:
        raise ValueError(f"--param: {error}") from None
    description: dict[str, object] = {"workload": workload.name, "seed": args.seed, "params": asdict(params)}
    return _Source(workload.name, description), generate(
        workload.name, seed=args.seed, block_size=block_size, overrides=overrides
    )


def _workload_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The workload parameters --param and --requests set; ValueError when both set the request count."""
    overrides: dict[str, str] = dict(args.param)
    if args.requests is not None:
        if "requests" in overrides:
            raise ValueError(
                f"--requests {args.requests} and --param requests={overrides['requests']} both set the request"
                " count; give one"
            )
        overrides["requests"] = str(args.requests)
    return overrides


def _percent(rate: float) -> str:
    return f"{100 * rate:.1f}%"


def _gib(size: float) -> str:
    gib = size / GIB
    return f"{gib:.3g}" if gib < 1000 else f"{gib:,.0f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a table: right-aligned columns under their headers and a rule."""
    widths = [max([len(header), *(len(row[i]) for row in rows)]) for i, header in enumerate(headers)]
    lines = ["  ".join(header.rjust(width) for header, width in zip(headers, widths))]
    lines.append("  ".join("-" * width for width in widths))
    return lines + ["  ".join(value.rjust(width) for value, width in zip(row, widths)) for row in rows]


def _recommendation_lines(
    found: Recommendation, order: CallOrder, geometry: ModelGeometry, ceiling: float, largest: int, working_set: int
) -> list[str]:
    """The answer: the configuration of ``found``, or why no size reached the target.

    ``ceiling`` is the rate with room for the whole trace, ``largest`` the
    largest capacity tried and ``working_set`` the bytes the whole trace takes:
    they tell a target no host memory reaches from one that larger sizes would.
    """
    target = _percent(found.target)
    point = found.point
    if point is None or found.kv_transfer_config is None or found.slab_bytes_per_rank is None:
        best = found.best
        lines = [
            f"NO SIZE TRIED REACHES THE TARGET: {found.rate_name} stays below {target} at every size tried;",
            f"  the best is {_percent(best.rate(order.name))} ({best.policy.upper()}, {format_bytes(best.capacity_bytes)}).",
        ]
        rest = "first-time blocks, or blocks the GPU cache serves" if order.name == "vllm" else "first-time blocks"
        if ceiling < found.target - 1e-12:
            lines.append(
                f"  unreachable: the ceiling, {_percent(ceiling)}, is below the target: no amount of host memory"
                f" reaches it (the rest are {rest}); lower --target-hit-rate"
            )
        elif largest < working_set:
            lines.append(
                f"  Try larger --capacities: the largest tried, {format_bytes(largest)}, holds less than the whole"
                f" trace ({format_bytes(working_set)}), with which the rate reaches {_percent(ceiling)}."
            )
        else:
            lines.append(
                f"  The sizes tried hold the whole trace ({format_bytes(working_set)}): the ceiling,"
                f" {_percent(ceiling)}, is all the offload tier gives; lower --target-hit-rate."
            )
        return lines
    flags = _server_flags(geometry, order)
    if found.tensor_parallel_size > 1:
        flags.append(f"--tensor-parallel-size {found.tensor_parallel_size}")
    slab = found.slab_bytes_per_rank
    workers = (
        "the worker process pins"
        if found.tensor_parallel_size == 1
        else f"each of the {found.tensor_parallel_size} worker processes pins"
    )
    lines = [
        f"smallest size reaching {target} ({found.rate_name}): {format_bytes(point.capacity_bytes)} with"
        f" {point.policy.upper()}, {_percent(point.rate(order.name))}",
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
    if isinstance(order, VllmOrder) and order.gpu_blocks is None:
        lines.append(
            "note:      modelled with the engine's prefix cache off; give --gpu-blocks (vLLM's num_gpu_blocks) to"
            " count only what the GPU cache does not serve, as vLLM does"
        )
    return lines


def _server_flags(geometry: ModelGeometry, order: CallOrder) -> list[str]:
    """The ``vllm serve`` flags of the server the replay modelled: its block size and the scheduler limits given."""
    flags = [f"--block-size {geometry.block_size}"]
    if isinstance(order, VllmOrder) and order.max_num_seqs is not None:
        flags.append(f"--max-num-seqs {order.max_num_seqs}")
    if isinstance(order, VllmOrder) and order.max_num_batched_tokens != DEFAULT_MAX_NUM_BATCHED_TOKENS:
        flags.append(f"--max-num-batched-tokens {order.max_num_batched_tokens}")
    return flags


def _serve_lines(extra_config: object, transfer_config: object, flags: Sequence[str]) -> list[str]:
    """How to start vLLM with the configuration found: its extra config, then the `vllm serve` command line."""
    return [
        "kv_connector_extra_config:",
        "  " + json.dumps(extra_config),
        "",
        "vllm serve <model> " + " ".join(flags) + " \\",
        f"  --kv-transfer-config '{json.dumps(transfer_config, separators=(',', ':'))}'",
        "",
    ]


# --------------------------------------------------------------------------
# Plot


class _Axes(Protocol):
    """The few matplotlib Axes methods the plot uses, typed (matplotlib's stubs leave ``**kwargs`` unknown)."""

    def plot(
        self, x: Sequence[float], y: Sequence[float], *, marker: str, linestyle: str, markersize: float,
        markerfacecolor: str, label: str,
    ) -> object: ...  # fmt: skip
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


def _plot(
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
    axes.axhline(100 * target, color="tab:red", linestyle="-", linewidth=1, label=f"target {_percent(target)}")
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


# --------------------------------------------------------------------------
# The command


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        geometry = _geometry(args)
        geometries = [geometry, *_compressed(args, geometry)]
        order = _call_order(args)
        source, requests = _load_trace(args, geometry.block_size)
    except (ValueError, OSError) as error:
        return command_error("simulate", error)
    stored = geometries[-1]  # the geometry the recommendation is for: the compressed one when asked
    if args.tier is not None and isinstance(order, VllmOrder):  # --tier selects vLLM's order (_call_order)
        return _run_tiered(args, stored, order, source, requests, started)
    tier_only = _given_flags(
        ("--tier-sizes", args.tier_sizes is not None),
        ("--host-price-ratio", args.host_price_ratio != DEFAULT_HOST_PRICE_RATIO),
        ("--servers", args.servers != 1),
    )
    if tier_only:
        return command_error("simulate", f"{tier_only[0]} applies with --tier (fs or mooncake)")
    prepared = prepare(requests)
    summary = summarize(prepared)
    try:
        capacities = _holding_a_block(
            args.capacities or default_capacities(geometry, summary.distinct_blocks), geometry
        )
        # The ceiling: capacity for every distinct block, so nothing is ever evicted.
        unlimited, unlimited_server = order.replay(
            prepared, CPUOffloadingManager(max(summary.distinct_blocks, 1), cache_policy="lru"), geometry.block_size
        )
        curves = {
            each.compression: [
                PointReport.of(point, each, args.bandwidth)
                for point in sweep(prepared, each, capacities, args.policies, order=order, track=_ProgressBar(args))
            ]
            for each in geometries
        }
    except (ValueError, RuntimeError) as error:  # the server model refuses a request the GPU cache cannot hold
        return command_error("simulate", error)
    reports = [report for curve in curves.values() for report in curve]
    unlimited_rate = unlimited_server.external_hit_rate if unlimited_server is not None else unlimited.token_hit_rate
    tp = args.tensor_parallel_size
    found = recommend(curves[stored.compression], args.target_hit_rate, order.name, stored, tensor_parallel_size=tp)
    uncompressed = recommend(curves["none"], args.target_hit_rate, order.name, geometry, tensor_parallel_size=tp)
    working_set = summary.distinct_blocks * geometry.bytes_per_block
    stored_working_set = summary.distinct_blocks * stored.stored_bytes_per_block
    record = _record(
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
            "unlimited_external_hit_rate": unlimited_rate,
            "gpu_share": unlimited_server.gpu_share if unlimited_server is not None else 0.0,
        },
        call_order={"name": order.name, **asdict(order)},
        bandwidth_gbps=args.bandwidth,
        points=[asdict(report) for report in reports],
        recommendation=_recommendation_record(found, stored),
        **(
            {"recommendation_uncompressed": _recommendation_record(uncompressed, geometry)}
            if stored is not geometry
            else {}
        ),
    )
    lines = [
        f"trace     {source.name}: {summary.requests} requests, {summary.prompt_blocks} prompt blocks"
        f" ({summary.prompt_tokens} tokens), {summary.output_blocks} output blocks",
        f"geometry  {stored.describe()}",
    ]
    compressed_set = ""
    if stored is not geometry:
        compressed_set = f", {format_bytes(stored_working_set)} stored {stored.compression}"
    lines.append(f"working set {format_bytes(working_set)}{compressed_set} ({summary.distinct_blocks} distinct blocks)")
    if isinstance(order, VllmOrder) and unlimited_server is not None:
        lines.append(f"server    {_describe_server(order)}")
        lines.append(
            f"with unlimited host memory vLLM would report {_percent(unlimited_rate)};"
            f" the GPU prefix cache serves {_percent(unlimited_server.gpu_share)} of prompt tokens"
        )
    else:
        lines.append(f"with unlimited memory {_percent(unlimited.token_hit_rate)} of prompt tokens hit")
    headers = _TABLE_HEADERS[order.name]
    for compression, curve in curves.items():
        lines.append("")
        if stored is not geometry:
            lines.append(f"{compression}: {_curve_heading(compression, stored)}")
        lines += _table(headers, [[_COLUMNS[header](report) for header in headers] for report in curve])
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
    lines += _recommendation_lines(found, order, stored, unlimited_rate, max(capacities), working_set)
    if stored is not geometry:
        lines.append(_uncompressed_line(uncompressed, found, order.name))
    json_path = _write_and_print(args, f"simulate-{source.name}.json", record, lines)
    if json_path is None:
        return 2
    # The answer first: the plot comes after it, so a missing or failing plot costs only the picture.
    written = [json_path]
    if not args.no_plot:
        png_path = args.out / f"simulate-{source.name}.png"
        title = (
            f"{source.name} trace, {summary.requests} requests, {geometry.name}"
            f" ({format_bytes(geometry.bytes_per_block)}/block)"
        )
        if isinstance(order, VllmOrder) and order.gpu_blocks is not None:
            title += f", {order.gpu_blocks} GPU blocks"
        if stored is not geometry:
            title += f"; with and without {stored.compression}"
        compressed_fits = stored_working_set / GIB if stored is not geometry else None
        try:
            _plot(
                png_path,
                reports,
                title,
                unlimited_rate,
                working_set / GIB,
                order.name,
                args.target_hit_rate,
                compressed_fits,
                stamp=plot_stamp(record),
            )
            written.append(png_path)
        except ImportError as error:  # matplotlib is optional: vLLM's own environment may not have it
            print(
                f"kvtriton simulate: no plot: {error.name or 'matplotlib'} is not installed"
                " (pip install matplotlib to draw it, --no-plot to skip it)",
                file=sys.stderr,
            )
        except OSError as error:
            return command_error("simulate", f"--out {args.out}: cannot write the plot: {error}")
    wrote = "wrote " + " and ".join(str(path) for path in written)
    if args.json:
        print(wrote, file=sys.stderr)
    else:
        print()
        print(wrote)
    return 0


def _compressed(args: argparse.Namespace, geometry: ModelGeometry) -> list[ModelGeometry]:
    """The compressed geometry ``--compression`` asks for (none: no second curve); ValueError naming the flag."""
    compression: str = args.compression
    if compression == "none":
        if args.group_size is not None:
            raise ValueError(f"--group-size {args.group_size} applies only with --compression fp8-e4m3")
        return []
    return [geometry.with_compression(compression, args.group_size)]


def _curve_heading(compression: str, stored: ModelGeometry) -> str:
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


def _uncompressed_line(uncompressed: Recommendation, found: Recommendation, order: str) -> str:
    """How the recommendation compares with the sweep without compression."""
    if uncompressed.point is None:
        return f"without compression: no size tried reaches {_percent(uncompressed.target)}"
    size = format_bytes(uncompressed.point.capacity_bytes)
    rate = _percent(uncompressed.point.rate(order))
    if found.point is None:
        return f"without compression: {size} with {uncompressed.point.policy.upper()}, {rate}"
    return f"without compression: {size} with {uncompressed.point.policy.upper()}, {rate} (compressed: {format_bytes(found.point.capacity_bytes)})"


def _recommendation_record(found: Recommendation, geometry: ModelGeometry) -> dict[str, object]:
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


def _describe_server(order: VllmOrder) -> str:
    if order.sequential:
        arrivals = "one request at a time"
    elif order.arrivals is not None:
        arrivals = f"{order.arrivals} arrivals per step"
    else:
        arrivals = "all requests at once"
    parts = [
        arrivals,
        f"max_num_seqs {order.max_num_seqs}" if order.max_num_seqs is not None else "no max_num_seqs",
        f"{order.max_num_batched_tokens} batched tokens",
        f"{order.gpu_blocks} GPU blocks, prefix cache on" if order.gpu_blocks is not None else "prefix cache off",
        f"{order.decode_steps} output tokens",
        f"loads done after {order.load_steps} step(s), stores after {order.store_steps}",
    ]
    return ", ".join(parts)


_COLUMNS: dict[str, Callable[[PointReport], str]] = {
    "policy": lambda report: report.policy,
    "GiB": lambda report: _gib(report.capacity_bytes),
    "blocks": lambda report: str(report.num_blocks),
    "vLLM hit": lambda report: _percent(report.external_hit_rate),
    "GPU": lambda report: _percent(report.gpu_share),
    "host": lambda report: _percent(report.offload_share),
    "computed": lambda report: _percent(report.computed_share),
    "hit blk": lambda report: _percent(report.block_hit_rate),
    "hit tok": lambda report: _percent(report.token_hit_rate),
    "loaded GiB": lambda report: _gib(report.bytes_loaded),
    "stored GiB": lambda report: _gib(report.bytes_stored),
    "evictions": lambda report: str(report.evictions),
    "refused": lambda report: str(report.refused_stores),
    "load s": lambda report: f"{report.load_seconds:.2f}",
    "store s": lambda report: f"{report.store_seconds:.2f}",
}
"""The columns of a sweep's table: each header and how a point fills it."""

_TABLE_HEADERS: dict[str, tuple[str, ...]] = {
    "vllm": ("policy", "GiB", "blocks", "vLLM hit", "GPU", "host", "computed", "loaded GiB", "stored GiB",
             "evictions", "refused", "load s", "store s"),
    "kvtriton": ("policy", "GiB", "blocks", "hit blk", "hit tok", "stored GiB", "loaded GiB",
                 "evictions", "refused", "load s", "store s"),
}  # fmt: skip
"""The table's columns per call order: in vLLM's, its reported rate and where prompt tokens came from; else the
host tier's rates."""


# --------------------------------------------------------------------------
# Across tiers (--tier)

DEFAULT_TIERED_POINTS = 4
"""Host sizes, and Mooncake pool sizes, a tiered sweep tries when none are given (each pair is a replay)."""


def _tiers(args: argparse.Namespace, geometry: ModelGeometry, distinct_blocks: int) -> list[TierSpec]:
    """The tier sizes to sweep: fs has one (it never evicts), a Mooncake pool its size or --tier-sizes."""
    tier: TierSpec = args.tier
    sizes: list[int] | None = args.tier_sizes
    if tier.kind == "fs" or tier.capacity_bytes is not None:
        if sizes is not None:
            raise ValueError(
                f"--tier-sizes sweeps a Mooncake pool's size; --tier {tier.describe()} has {'none' if tier.kind == 'fs' else 'one'}"
            )
        return [tier]
    if sizes is None:
        sizes = default_capacities(geometry, distinct_blocks, DEFAULT_TIERED_POINTS)
    return [TierSpec("mooncake", size) for size in sizes]


def _server_streams(args: argparse.Namespace, block_size: int, first: list[Request]) -> list[list[Request]]:
    """One request stream per server: the workload drawn with --seed as streams 0..N-1 (shared popular prompts)."""
    if args.servers == 1:
        return [first]
    if args.trace is not None:
        raise ValueError("--servers draws one request stream per server from a built-in workload; not from --trace")
    overrides = _workload_overrides(args)
    return [first] + [
        generate(args.workload, seed=args.seed, block_size=block_size, overrides=overrides, stream=stream)
        for stream in range(1, args.servers)
    ]


def _run_tiered(
    args: argparse.Namespace,
    geometry: ModelGeometry,
    order: VllmOrder,
    source: _Source,
    requests: list[Request],
    started: float,
) -> int:
    """``--tier``: the (policy, host size, tier size) sweep, a table per policy, the cheapest point as vLLM's config."""
    try:
        streams = [prepare(stream) for stream in _server_streams(args, geometry.block_size, requests)]
        distinct = summarize([request for stream in streams for request in stream]).distinct_blocks
        tiers = _tiers(args, geometry, distinct)
        for tier in tiers:
            tier.build(geometry)  # refuses a pool that holds no chunk
        hosts = _holding_a_block(
            args.capacities or default_capacities(geometry, distinct, DEFAULT_TIERED_POINTS), geometry
        )
        # Counted in requests, not points: one point of a long trace (or of many servers) can take minutes.
        bar = ProgressBar(
            sweep_requests(streams, hosts, tiers, args.policies), "simulate (requests)", enabled=not args.no_progress
        )
        reports = tiered_sweep(streams, geometry, hosts, tiers, args.policies, order, on_finished=bar.advance)
        bar.finish()
        found = recommend_tiered(reports, args.target_hit_rate, args.host_price_ratio, geometry)
    except (ValueError, RuntimeError) as error:
        return command_error("simulate", error)
    summary = summarize(streams[0])
    working_set = distinct * geometry.stored_bytes_per_block
    lines = [
        f"trace     {source.name}: {summary.requests} requests, {summary.prompt_blocks} prompt blocks"
        f" ({summary.prompt_tokens} tokens)" + (f", per server; {args.servers} servers" if args.servers > 1 else ""),
        f"geometry  {geometry.describe()}",
        f"working set {format_bytes(working_set)} ({distinct} distinct blocks"
        + (", every server's" if args.servers > 1 else "")
        + ")",
        f"server    {_describe_server(order)}",
        f"tiers     host memory per server, then {_tier_heading(args.tier, args.servers)}",
    ]
    for policy in args.policies:
        lines.append("")
        lines += _table(*_tiered_rows([r for r in reports if r.policy == policy], args.host_price_ratio))
    if any(report.stalled for report in reports):
        lines.append("")
        lines.append(
            "stalled: a request's prefix did not fit the host tier, so promoting it evicted what was already promoted"
            " and the request never ran (vLLM's engine would stall the same way): give the host tier more room"
        )
    lines.append("")
    lines += _tiered_recommendation_lines(found, order, geometry, args.servers)
    record = _record(
        args,
        source,
        started,
        servers=args.servers,
        tier=args.tier.describe(),
        host_price_ratio=args.host_price_ratio,
        compression=geometry.compression,
        stored_bytes_per_block=geometry.stored_bytes_per_block,
        working_set_bytes=working_set,
        call_order={"name": order.name, **asdict(order)},
        points=[_tiered_point_record(report, args.host_price_ratio) for report in reports],
        recommendation={
            "target_hit_rate": found.target,
            "reached": found.point is not None,
            "point": _tiered_point_record(found.point, args.host_price_ratio) if found.point is not None else None,
            "kv_connector_extra_config": found.extra_config,
        },
    )
    json_path = _write_and_print(args, f"simulate-{source.name}-tiered.json", record, lines)
    if json_path is None:
        return 2
    print(f"wrote {json_path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _tier_heading(tier: TierSpec, servers: int) -> str:
    shared = f", shared by {servers} servers" if servers > 1 else ""
    if tier.kind == "fs":
        return f"vLLM's fs tier (no capacity, never evicts: its column is the disk it filled){shared}"
    return (
        f"a Mooncake Store pool (its master evicts {MOONCAKE_EVICTION_RATIO:.0%} of the objects, least recently"
        f" used first, past {MOONCAKE_HIGH_WATERMARK:.0%} full){shared}"
    )


def _tiered_point_record(report: TieredReport, ratio: float) -> dict[str, object]:
    return {
        **asdict(report),
        "external_hit_rate": report.external_hit_rate,
        "host_chunk_hit_rate": report.host_chunk_hit_rate,
        "tier_chunk_hit_rate": report.tier_chunk_hit_rate,
        "tier_read_bytes": report.tier_read_bytes,
        "tier_write_bytes": report.tier_write_bytes,
        "tier_fill_bytes": report.tier_fill_bytes,
        "cost_tier_gib": report.cost(ratio),
    }


def _tiered_rows(reports: Sequence[TieredReport], ratio: float) -> tuple[list[str], list[list[str]]]:
    """Per (host size, tier size): the rate vLLM reports, each tier's chunk hits, the bytes each moves, the cost."""
    headers = ["policy", "host GiB", "tier GiB", "vLLM hit", "host hit", "tier hit", "promoted", "host load GiB",
               "host store GiB", "tier read GiB", "tier write GiB", "tier evictions", "cost"]  # fmt: skip
    rows: list[list[str]] = []
    for report in reports:
        mooncake = report.tier.kind == "mooncake"
        counts = report.counts
        if counts is None:  # stalled: the replay stopped, so there is nothing to count
            tier_size = _gib(report.tier.capacity_bytes or 0) if mooncake else "-"
            counted = ["stalled", *["-"] * 9]
        else:
            tier_size = _gib(report.tier_size_bytes) if mooncake else f"{_gib(report.tier_fill_bytes)} filled"
            counted = [
                _percent(report.external_hit_rate),
                f"{_percent(report.host_chunk_hit_rate)} of {counts.host_chunk_queries}",
                f"{_percent(report.tier_chunk_hit_rate)} of {counts.tier_chunk_queries}",
                str(counts.promotions),
                _gib(report.host_load_bytes),
                _gib(report.host_store_bytes),
                _gib(report.tier_read_bytes),
                _gib(report.tier_write_bytes),
                str(counts.tier_evictions),
                f"{report.cost(ratio):.3g}",
            ]
        rows.append([report.policy, _gib(report.host_bytes), tier_size, *counted])
    return headers, rows


def _tiered_recommendation_lines(
    found: TieredRecommendation, order: VllmOrder, geometry: ModelGeometry, servers: int
) -> list[str]:
    target = _percent(found.target)
    point = found.point
    price = f"host memory priced {found.host_price_ratio:g}x a tier GiB"
    if point is None or found.extra_config is None:
        best = found.best
        return [
            f"NO POINT TRIED REACHES THE TARGET: the hit rate vLLM reports stays below {target} ({price});",
            f"  the best is {_percent(best.external_hit_rate)} ({best.policy.upper()}, host"
            f" {format_bytes(best.host_bytes)}, {best.tier.describe()}): try larger --capacities or --tier-sizes,"
            " or lower --target-hit-rate.",
        ]
    tier_size = (
        f"a Mooncake pool of {format_bytes(point.tier_size_bytes)}"
        if point.tier.kind == "mooncake"
        else f"an fs tier that fills {format_bytes(point.tier_fill_bytes)} over the trace"
    )
    per_server = " per server" if servers > 1 else ""
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": found.extra_config,
    }
    flags = _server_flags(geometry, order)
    lines = [
        f"cheapest point reaching {target} (the hit rate vLLM reports; {price}):"
        f" {format_bytes(point.host_bytes)} of host memory{per_server} with {point.policy.upper()} and {tier_size},"
        f" {_percent(point.external_hit_rate)} (cost {point.cost(found.host_price_ratio):.3g} tier-GiB)",
        "",
        *_serve_lines(found.extra_config, transfer, flags),
        f"/dev/shm:  the tiering spec maps its host memory there: about {format_bytes(point.host_bytes)} free",
    ]
    if point.tier.kind == "mooncake":
        lines.append(
            f"pool:      the holders' --global_segment_size adding up to {format_bytes(point.tier_size_bytes)}"
            ' (docs/tiers.md, "Deploying Mooncake Store")'
        )
    else:
        lines.append(
            f"disk:      {format_bytes(point.tier_fill_bytes)} under root_dir after this trace; fs never evicts,"
            " so it keeps growing with every new prefix (clear it yourself)"
        )
    if geometry.compression != "none":
        lines.append(
            f"lossy:     {COMPRESSION_EXTRA_CONFIG_KEY}={geometry.compression}: both tiers hold the compressed rows"
        )
    return lines


# --------------------------------------------------------------------------
# Output shared by both sweeps


@dataclass(frozen=True, slots=True)
class _ProgressBar:
    """A sweep's ``track``: a progress bar on stderr over the points replayed, unless --no-progress."""

    args: argparse.Namespace

    def __call__(self, grid: Sequence[GridT]) -> Iterable[GridT]:
        return progress(grid, len(grid), "simulate", enabled=not self.args.no_progress)


def _holding_a_block(capacities: list[int], geometry: ModelGeometry) -> list[int]:
    """``capacities``; ValueError naming the first that holds no block of ``geometry``."""
    too_small = [capacity for capacity in capacities if geometry.blocks_for(capacity) < 1]
    if too_small:
        raise ValueError(
            f"--capacities: {format_bytes(too_small[0])} holds no block of {format_bytes(geometry.stored_bytes_per_block)}"
        )
    return capacities


def _record(args: argparse.Namespace, source: _Source, started: float, **fields: object) -> dict[str, object]:
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


def _write_and_print(args: argparse.Namespace, name: str, record: dict[str, object], lines: list[str]) -> Path | None:
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
