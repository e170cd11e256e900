"""`kvtriton simulate`'s arguments: the flags, their parsers, and what they select (geometry, call order, trace, tiers)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from kvtriton.cli._main import add_choice_argument, choice_argument
from kvtriton.manager.policies import POLICIES, policy_names
from kvtriton.sim import (
    CALL_ORDER_ALIASES,
    CALL_ORDERS,
    DEFAULT_AFFINITY_BLOCKS,
    DEFAULT_ARRIVALS,
    DEFAULT_DECODE_STEPS,
    DEFAULT_HOST_PRICE_RATIO,
    DEFAULT_LOAD_STEPS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_ROUTER,
    DEFAULT_STORE_STEPS,
    DEFAULT_SWEEP_POINTS,
    POOL_KNEE_POINTS,
    PRESETS,
    ROUTERS,
    TIER_MODELS,
    WORKLOADS,
    CallOrder,
    KvtritonOrder,
    ModelGeometry,
    Request,
    TierSpec,
    TraceBlockSizeMismatch,
    VllmOrder,
    check_host_bytes,
    check_tier_bytes,
    default_capacities,
    format_bytes,
    generate,
    parse_dtype,
    parse_tier,
    read_trace,
    size_argument,
    tier_help,
    tier_metavar,
)

DEFAULT_OUT = "simulate-results"
DEFAULT_WORKLOAD = "chat"
DEFAULT_MODEL = "llama-3-8b"
DEFAULT_POLICIES = tuple(POLICIES)  # every registered policy, in the order the registry lists them
DEFAULT_BANDWIDTH_GBPS = 25.0
DEFAULT_TARGET_HIT_RATE = 0.5
COMPRESSIONS = ("none", "fp8-e4m3")
"""``--compression`` values: kvtriton's slab row formats (kvtriton.kernels._compression.KVCompression)."""


# --------------------------------------------------------------------------
# Command line


NumberT = TypeVar("NumberT", int, float)
ParsedT = TypeVar("ParsedT")


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


def _sizes(check_bound: Callable[[int, str], None]) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated sizes, each positive, once, and within ``check_bound``."""

    def convert(text: str) -> list[int]:
        sizes: dict[int, str] = {}
        for item in _listed(text, "sizes"):
            if item.startswith("-"):
                raise argparse.ArgumentTypeError(f"sizes must be positive, got {item!r}")
            size = size_argument(item)
            try:
                check_bound(size, item)
            except ValueError as error:
                raise argparse.ArgumentTypeError(str(error)) from None
            if size in sizes:
                raise argparse.ArgumentTypeError(
                    f"{sizes[size]!r} and {item!r} are the same size ({format_bytes(size)}): give each size once"
                )
            sizes[size] = item
        return sorted(sizes)

    return convert


_capacities = _sizes(check_host_bytes)
_tier_sizes = _sizes(check_tier_bytes)


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


@dataclass(frozen=True, slots=True)
class ArrivalPattern:
    """An ``--arrivals`` value: ``burst``, ``concurrency`` N, ``rate`` R (requests per step) or ``per-step`` N."""

    kind: str
    value: float = 0.0


def _arrivals(text: str) -> ArrivalPattern:
    """``burst``, ``concurrency:N``, ``rate:R`` or a bare N (new requests per step)."""
    name, sep, value = text.strip().lower().partition(":")
    if not sep and name == "burst":
        return ArrivalPattern("burst")
    if not sep and name.isdigit() and int(name) >= 1:
        return ArrivalPattern("per-step", int(name))
    if sep and name == "concurrency" and value.strip().isdigit() and int(value) >= 1:
        return ArrivalPattern("concurrency", int(value))
    if sep and name == "rate":
        try:
            rate = float(value)
        except ValueError:
            rate = math.nan
        if math.isfinite(rate) and rate > 0:
            return ArrivalPattern("rate", rate)
    raise argparse.ArgumentTypeError(
        "expected burst, concurrency:N (N >= 1), rate:R (R > 0 requests per scheduler step) or N (new requests"
        f" per step, N >= 1), got {text!r}"
    )


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


def add_arguments(parser: argparse.ArgumentParser, description: str) -> None:
    """The command's flags, in groups, with ``description`` and the workloads and presets as the help's epilog."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = description
    parser.epilog = _workloads_epilog()
    _add_trace_arguments(parser)
    _add_geometry_arguments(parser)
    sweep_group = _add_sweep_arguments(parser)
    _add_server_arguments(parser)
    _add_answer_arguments(sweep_group)
    _add_tier_arguments(parser)
    _add_fleet_arguments(parser)
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
        "What the vLLM server is started with, and how its client sends the requests (--arrivals or --sequential).",
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
        f" so a burst of them is admitted (default: {DEFAULT_MAX_NUM_SEQS}, vllm serve's on a GPU under 70 GiB,"
        " or --max-num-batched-tokens when that is lower; the printed vllm serve line sets it)",
    )
    server.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        metavar="N",
        help=f"vLLM's --max-num-batched-tokens: tokens computed per step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS},"
        " vllm serve's on a GPU under 70 GiB; the printed vllm serve line sets it)",
    )
    arrival = server.add_mutually_exclusive_group()
    arrival.add_argument(
        "--arrivals",
        type=_arrivals,
        metavar="burst|concurrency:N|rate:R|N",
        help="how the requests arrive, as vllm bench serve sends them: 'burst' all at once (--request-rate inf),"
        " 'concurrency:N' N in flight, the next sent the step after one finished (--max-concurrency N), 'rate:R'"
        " Poisson arrivals of R requests per scheduler step on average, seeded by --seed (--request-rate), or N new"
        f" requests every step (default: {DEFAULT_ARRIVALS} per step when neither --max-num-seqs nor --sequential"
        " is given, else burst)",
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
        " its share (for the pinned-memory advice and the printed vllm serve line; default: 1)",
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
        " percentage (the rate vLLM reports with --call-order vllm, the token hit rate otherwise; with --engines,"
        " the fleet's hit share, the prompt tokens no engine computes;"
        f" default: {DEFAULT_TARGET_HIT_RATE:g})",
    )


def _add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    tiers = parser.add_argument_group(
        "second tier (vLLM's tiered offloading behind the host tier; implies --call-order vllm)",
        "Stores cascade from host memory to the tier, a chunk found only there is promoted back first (the request"
        " waits for it). Each (policy, host size, tier size) point is printed with both tiers' rates.",
    )
    # The tier registry (kvtriton.sim.TIER_MODELS) names the tiers and says what each models.
    tiers.add_argument("--tier", type=_tier, metavar=tier_metavar(), help=tier_help())
    sized = "|".join(model.name for model in TIER_MODELS.values() if model.sized)
    tiers.add_argument(
        "--tier-sizes",
        type=_tier_sizes,
        metavar="LIST",
        help=f"--tier {sized}: tier sizes to sweep, comma-separated, units as --capacities (default:"
        f" {DEFAULT_TIERED_POINTS} sizes doubling up to the first power-of-two GiB that holds the whole trace)",
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


def _add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    fleet = parser.add_argument_group(
        "fleet (N engines behind a router, sharing one Mooncake pool; implies --call-order vllm and --tier mooncake)",
        "The trace is routed to N engines, each with its own GPU prefix cache and host tier of each --capacities"
        " size, all in front of one pool of each --tier-sizes size (or --tier mooncake:SIZE). The server model's"
        " flags (--gpu-blocks, --max-num-seqs, --arrivals, ...) are each engine's. Prints each engine's hits, the"
        f" pool size past which a larger pool buys less than {POOL_KNEE_POINTS:g} point of hit share, and the"
        " vllm serve line of every engine.",
    )
    fleet.add_argument(
        "--engines",
        type=_positive_int,
        metavar="N",
        help="model a fleet of N engines sharing one pool (default: one engine, no fleet)",
    )
    fleet.add_argument(
        "--router",
        type=choice_argument(ROUTERS),
        choices=ROUTERS,
        help="--engines: which engine serves each request: 'round-robin' (request i to engine i mod N) or"
        " 'prefix-affinity' (a hash of the prompt's first --affinity-blocks blocks picks the engine, so requests"
        f" sharing that prefix meet on one engine) (default: {DEFAULT_ROUTER})",
    )
    fleet.add_argument(
        "--affinity-blocks",
        type=_positive_int,
        metavar="K",
        help="--router prefix-affinity: blocks of the prompt the router hashes; pick K past the prefix every"
        f" request shares (one system prompt) and within the prefixes groups of requests share (default:"
        f" {DEFAULT_AFFINITY_BLOCKS})",
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
class Source:
    """Where the trace came from: its name (for the files written) and what the JSON record says of it."""

    name: str
    description: dict[str, object] = field(default_factory=dict[str, object])


def geometry_of(args: argparse.Namespace) -> ModelGeometry:
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


def call_order_of(args: argparse.Namespace) -> CallOrder:
    """The call order the flags ask for; ValueError naming the flag that does not apply."""
    server_flags = given_flags(
        ("--gpu-blocks", args.gpu_blocks is not None),
        ("--max-num-seqs", args.max_num_seqs is not None),
        ("--sequential", args.sequential),
        ("--tier", args.tier is not None),
        ("--engines", args.engines is not None),
    )
    # The server model's other knobs: given alone they do not select vLLM's order (each has a default there).
    model_flags = given_flags(
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
    batched = _given(args.max_num_batched_tokens, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    max_num_seqs = _given(args.max_num_seqs, min(DEFAULT_MAX_NUM_SEQS, batched))
    if max_num_seqs > batched:
        given = "" if args.max_num_batched_tokens is not None else " (its default)"
        raise ValueError(
            f"--max-num-seqs {max_num_seqs} is more than --max-num-batched-tokens {batched}{given}, which vLLM"
            " refuses: lower --max-num-seqs or raise --max-num-batched-tokens"
        )
    pattern: ArrivalPattern | None = args.arrivals
    if pattern is None:
        default = args.max_num_seqs is not None or args.sequential
        pattern = ArrivalPattern("burst") if default else ArrivalPattern("per-step", DEFAULT_ARRIVALS)
    return VllmOrder(
        arrivals=int(pattern.value) if pattern.kind == "per-step" else None,
        sequential=args.sequential,
        concurrency=int(pattern.value) if pattern.kind == "concurrency" else None,
        request_rate=pattern.value if pattern.kind == "rate" else None,
        arrival_seed=args.seed if pattern.kind == "rate" else 0,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        gpu_blocks=args.gpu_blocks,
        decode_steps=_given(args.decode_steps, DEFAULT_DECODE_STEPS),
        load_steps=_given(args.load_steps, DEFAULT_LOAD_STEPS),
        store_steps=_given(args.store_steps, DEFAULT_STORE_STEPS),
        sync_loads=args.sync_loads,
    )


def given_flags(*flags: tuple[str, bool]) -> list[str]:
    """The names of the ``(flag, given)`` pairs whose flag was given, in order."""
    return [flag for flag, given in flags if given]


def _given(value: int | None, default: int) -> int:
    """A flag's value, or its default when it was not given (None: the flag's own default, so "given" is known)."""
    return default if value is None else value


def load_trace(args: argparse.Namespace, block_size: int) -> tuple[Source, list[Request]]:
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
        except TraceBlockSizeMismatch as mismatch:
            read_at = f"--block-size {block_size}" if args.block_size else f"the default --block-size, {block_size}"
            if mismatch.from_header is not None:
                raise ValueError(
                    f"--trace {path}: this trace was written at {mismatch.written} tokens per block (its header:"
                    f" {mismatch.from_header!r}), not at {read_at}: pass --block-size {mismatch.written}"
                ) from None
            raise ValueError(
                f"--trace {mismatch.detail} at {read_at}; it fits {mismatch.written} tokens per block: if the"
                f" trace was written at {mismatch.written} tokens per block, pass --block-size {mismatch.written}"
            ) from None
        except OSError as error:
            raise ValueError(f"--trace: cannot read {path}: {error.strerror or error}") from None
        stem = Path(path.name.removesuffix(".gz")).stem  # my-trace.jsonl.gz writes simulate-my-trace.json
        return Source(stem, {"trace": str(path)}), requests
    overrides = _workload_overrides(args)
    workload = WORKLOADS[args.workload]
    try:
        params = workload.params(overrides)
    except ValueError as error:
        raise ValueError(f"--param: {error}") from None
    description: dict[str, object] = {"workload": workload.name, "seed": args.seed, "params": asdict(params)}
    return Source(workload.name, description), generate(
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


def compressed_geometries(args: argparse.Namespace, geometry: ModelGeometry) -> list[ModelGeometry]:
    """The compressed geometry ``--compression`` asks for (none: no second curve); ValueError naming the flag."""
    compression: str = args.compression
    if compression == "none":
        if args.group_size is not None:
            raise ValueError(f"--group-size {args.group_size} applies only with --compression fp8-e4m3")
        return []
    return [geometry.with_compression(compression, args.group_size)]


DEFAULT_TIERED_POINTS = 4
"""Host sizes, and Mooncake pool sizes, a tiered sweep tries when none are given (each pair is a replay)."""


def tier_specs(args: argparse.Namespace, geometry: ModelGeometry, distinct_blocks: int) -> list[TierSpec]:
    """The tier sizes to sweep: a tier without capacity (fs) has one point, a sized one its size or --tier-sizes."""
    tier: TierSpec = args.tier
    sizes: list[int] | None = args.tier_sizes
    if not tier.model.sized or tier.capacity_bytes is not None:
        if sizes is not None:
            has = "one" if tier.model.sized else "none"
            raise ValueError(f"--tier-sizes sweeps a tier's size; --tier {tier.describe()} has {has}")
        return [tier]
    if sizes is None:
        sizes = default_capacities(geometry, distinct_blocks, DEFAULT_TIERED_POINTS)
    return [TierSpec(tier.kind, size) for size in sizes]


def server_streams(args: argparse.Namespace, block_size: int, first: list[Request]) -> list[list[Request]]:
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


def holding_a_block(capacities: list[int], geometry: ModelGeometry) -> list[int]:
    """``capacities``; ValueError naming the first that holds no block of ``geometry``."""
    too_small = [capacity for capacity in capacities if geometry.blocks_for(capacity) < 1]
    if too_small:
        raise ValueError(
            f"--capacities: {format_bytes(too_small[0])} holds no block of {format_bytes(geometry.stored_bytes_per_block)}"
        )
    return capacities
