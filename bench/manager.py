"""Scheduler-side throughput: kvtriton's manager through its vLLM adapter against vLLM 0.33's, in vLLM's call order.

Headline (needs vLLM): the four workloads of ``kvtriton.sim._workloads.VLLM_ORDER_WORKLOADS``
(system prompts, multi-turn chat, a few-shot prefix tree, a hot set with
scans), each replayed in vLLM's call order (``kvtriton.sim._vllm_order``:
step by step, request hooks, token positions, no ``touch``) through vLLM's
``CPUOffloadingManager`` and through kvtriton's manager behind its vLLM adapter
(what a vLLM user runs), at ``--capacity-fraction`` of each trace's distinct
prompt blocks. Each round builds fresh managers and contexts, collects and
freezes the GC heap (vLLM's engine freezes its heap at start), then times one
replay per implementation, alternating which goes first; the table gives the
median blocks/s over ``--rounds`` rounds with the range, and the ratio of the
medians. The driver loop is the same code for both and counts in both.
``--hit-rates`` prints the block hit rates of both, in the same call order, at
5 %, 10 % and 20 % of each trace's distinct prompt blocks instead.

Second table: direct calls, kvtriton's own API with ``touch``, on the
``prefix-sharing`` workload (``kvtriton.sim._workloads``: each request starts
with part of a shared prefix chosen with Zipf popularity and ends with blocks
no other request has), replayed by ``kvtriton.sim._replay.replay_calls`` in
an engine's order: lookup until the first miss, prepare_load the hits, touch
all keys, prepare_store the rest; ``complete_load`` / ``complete_store``
arrive ``--inflight`` requests later. ``kvtriton simulate --workload
prefix-sharing --in-flight 5`` replays the very trace and call order, at any
capacity. The ``--requests`` ... ``--inflight`` options shape this table only.
It prints blocks per second (best of ``--repeats``) and hit rate per policy,
for kvtriton alone, vLLM's manager (with its request hooks; ``--vllm-touch``
adds the ``touch`` its connector no longer makes) and kvtriton through the
adapter.

``--quick`` is a smoke run: small traces, one round / replay, figures that
only show the command works (no goal is judged on them), written to
``<name>-quick.json``, never over the measured results.

    python -m bench.manager                         # both tables, a few minutes here
    python -m bench.manager --hit-rates             # the hit-rate table
    python -m bench.manager --quick                 # smoke run -> bench/results/manager-quick.json
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Protocol, TypeVar, cast

from bench.common import bench_parser, command_line, format_table, result_name, write_json
from kvtriton import OffloadKey, ReqContext
from kvtriton.cli import progress
from kvtriton.manager import CPUOffloadingManager, policy_names
from kvtriton.sim import (
    PRESETS,
    VLLM_ORDER_WORKLOADS,
    HookedManager,
    ManagerCalls,
    PrefixSharingParams,
    PreparedRequest,
    ReplayStats,
    generate,
    hooked_calls,
    manager_calls,
    positioned_contexts,
    prepare,
    replay_calls,
    replay_vllm_order,
)

__all__ = [
    "HeadlineRow",
    "ReplayResult",
    "Timing",
    "build_parser",
    "format_headline",
    "headline",
    "main",
    "replay",
    "simulate_command",
    "trace",
]

VLLM_MANAGER_MODULE = "vllm.v1.kv_offload.cpu.manager"
VLLM_BASE_MODULE = "vllm.v1.kv_offload.base"
WORKLOAD = "prefix-sharing"
BLOCK_TOKENS = 16
"""Tokens per block: the workload's block size (hashes depend on it) and the key positions vLLM's ReqContext records."""
SIMULATE_MODEL = "llama-3-8b"
"""Geometry of the equivalent ``kvtriton simulate`` command (it turns the slot capacity into bytes)."""
QUICK_REQUESTS = 1_000
"""Trace length of ``--quick`` (one replay per manager)."""
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def simulate_command(
    params: PrefixSharingParams, seed: int, capacity: int, inflight: int, policies: Sequence[str]
) -> str:
    """The ``kvtriton simulate`` command that replays this benchmark's trace, window and capacity.

    Its hit counts equal the benchmark's: same workload, seed and block size,
    ``--in-flight`` one more than ``--inflight`` (it counts the arriving
    request too), and ``capacity`` blocks given in bytes of the default model.
    """
    size = capacity * PRESETS[SIMULATE_MODEL].bytes_per_block
    unit, scale = next((unit, scale) for unit, scale in _UNITS if size % scale == 0)
    shape = "".join(f" --param {name}={value}" for name, value in asdict(params).items())
    return (
        f"kvtriton simulate --workload {WORKLOAD} --seed {seed}{shape} --model {SIMULATE_MODEL}"
        f" --block-size {BLOCK_TOKENS} --capacities {size // scale}{unit} --in-flight {inflight + 1}"
        f" --policies {','.join(policies)}"
    )


def trace(params: PrefixSharingParams, seed: int) -> list[PreparedRequest]:
    """The benchmark's requests: the ``prefix-sharing`` workload at ``BLOCK_TOKENS`` tokens per block, as keys."""
    return prepare(generate(WORKLOAD, seed=seed, block_size=BLOCK_TOKENS, overrides=asdict(params)))


# --- the replay ----------------------------------------------------------------

CtxT = TypeVar("CtxT")


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """One timed replay of a trace through one manager."""

    seconds: float
    blocks: int
    loaded: int
    """Blocks served from the cache (the lookup-until-miss prefix of each request)."""
    stored: int
    """Blocks ``prepare_store`` accepted."""
    failed_stores: int
    """``prepare_store`` calls answered ``None`` (no room could be made)."""
    evictions: int

    @classmethod
    def of(cls, seconds: float, stats: ReplayStats) -> ReplayResult:
        return cls(
            seconds=seconds,
            blocks=stats.prompt_blocks,
            loaded=stats.hit_blocks,
            stored=stats.blocks_stored,
            failed_stores=stats.refused_stores,
            evictions=stats.evictions,
        )

    @property
    def blocks_per_s(self) -> float:
        return self.blocks / self.seconds if self.seconds > 0 else float("inf")

    @property
    def hit_rate(self) -> float:
        return self.loaded / self.blocks if self.blocks else 0.0


def replay(
    calls: ManagerCalls[CtxT],
    requests: Sequence[PreparedRequest],
    contexts: Sequence[CtxT],
    inflight: int = 4,
) -> ReplayResult:
    """Replay ``requests`` (``contexts[i]`` is request ``i``'s context) through ``calls`` and time it.

    Completions of request ``i`` are delivered after request ``i + inflight``
    has been scheduled, so loads pin blocks and stores stay pending for a
    while, as they do while transfers run (``replay_calls`` with
    ``in_flight = inflight + 1``).
    """
    if inflight < 0:
        raise ValueError(f"inflight must be >= 0, got {inflight}")
    start = time.perf_counter()
    stats = replay_calls(calls, requests, contexts, block_size=BLOCK_TOKENS, in_flight=inflight + 1)
    return ReplayResult.of(time.perf_counter() - start, stats)


# --- vLLM, when installed --------------------------------------------------------


class _VllmContext(Protocol):
    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None: ...


class _VllmManager(HookedManager, Protocol):
    """vLLM's manager as the replay calls it (:class:`HookedManager`), and its ``touch``."""

    def touch(self, keys: Sequence[OffloadKey], req_context: _VllmContext, /) -> None: ...


@dataclass(frozen=True, slots=True)
class _Vllm:
    version: str
    make_manager: Callable[[int, str], _VllmManager]
    make_adapter: Callable[[int, str], _VllmManager]
    """kvtriton's manager behind its vLLM adapter: what vLLM really calls after the drop-in."""
    make_context: Callable[[str], _VllmContext]
    hit: object
    pending: object


def _load_vllm() -> _Vllm | str:
    """vLLM's manager pieces, or the reason they cannot be imported."""
    try:
        manager_module = importlib.import_module(VLLM_MANAGER_MODULE)
        base_module = importlib.import_module(VLLM_BASE_MODULE)
        version = str(getattr(importlib.import_module("vllm"), "__version__", "unknown"))
    except Exception as error:  # noqa: BLE001 -- vLLM missing, or present but broken (missing optional deps)
        return f"{type(error).__name__}: {error}"
    manager_cls = cast(Callable[..., _VllmManager], manager_module.CPUOffloadingManager)
    context_cls = cast(Callable[..., _VllmContext], base_module.ReqContext)
    lookup_result = cast(type, base_module.LookupResult)

    def make_manager(capacity: int, policy: str) -> _VllmManager:
        return manager_cls(capacity, cache_policy=policy, enable_events=False)

    def make_adapter(capacity: int, policy: str) -> _VllmManager:
        from kvtriton.integrations.vllm import VLLMOffloadingManager

        cpu = CPUOffloadingManager(capacity, policy)
        # The adapter takes vLLM's ReqContext; the protocol names only the part the replay uses.
        return cast(_VllmManager, VLLMOffloadingManager(cpu, cpu))

    def make_context(req_id: str) -> _VllmContext:
        return context_cls(req_id=req_id)

    return _Vllm(
        version,
        make_manager,
        make_adapter,
        make_context,
        getattr(lookup_result, "HIT"),
        getattr(lookup_result, "HIT_PENDING"),
    )


def _vllm_calls(vllm: _Vllm, manager: _VllmManager, with_touch: bool = False) -> ManagerCalls[_VllmContext]:
    """The replay calls of a vLLM 0.33 manager, with its per-request hooks (and ``touch`` if asked for)."""
    calls = hooked_calls(manager, hit=vllm.hit, pending=vllm.pending)
    return replace(calls, touch=manager.touch) if with_touch else calls


def _vllm_contexts(vllm: _Vllm, requests: Sequence[PreparedRequest], block_tokens: int) -> list[_VllmContext]:
    # The scheduler records each key's end-token position in the request's
    # context before calling the manager; do it here, outside the timed loop.
    return positioned_contexts(requests, vllm.make_context, block_size=block_tokens)


def _distinct_keys(requests: Sequence[PreparedRequest]) -> int:
    return len({key for request in requests for key in request.prompt_keys})


# --- the headline: vLLM's call order ----------------------------------------------

HEADLINE_FRACTION = 0.1
"""Default capacity of the headline, as a fraction of each trace's distinct prompt blocks."""
HEADLINE_ROUNDS = 9
"""Alternating rounds per point: kvtriton's replay takes about 0.15 s, so one hiccup of a shared machine moves a round
by tens of percent; the median of 9 stays put where 5 did not (two 5-round runs the same hour read 2.30x and 2.74x
for one row)."""
QUICK_HEADLINE_REQUESTS = 300


@dataclass(frozen=True, slots=True)
class Timing:
    """blocks/s over the rounds of one implementation: median and range."""

    median: float
    low: float
    high: float
    hit_rate: float

    @classmethod
    def of(cls, blocks: int, seconds: Sequence[float], hit_rate: float) -> Timing:
        rates = [blocks / max(second, 1e-12) for second in seconds]
        return cls(statistics.median(rates), min(rates), max(rates), hit_rate)


@dataclass(frozen=True, slots=True)
class HeadlineRow:
    workload: str
    policy: str
    capacity: int
    blocks: int
    vllm: Timing
    kvtriton_via_vllm_adapter: Timing
    """kvtriton through its vLLM adapter; named as the key of the result file, which asdict writes."""

    @property
    def speedup(self) -> float:
        return self.kvtriton_via_vllm_adapter.median / self.vllm.median


def _timed_vllm_order(
    manager: _VllmManager, vllm: _Vllm, requests: Sequence[PreparedRequest]
) -> tuple[float, ReplayStats]:
    """Set up contexts for a fresh ``manager``, freeze the GC heap, and time one vLLM-order replay."""
    contexts = _vllm_contexts(vllm, requests, BLOCK_TOKENS)
    calls = _vllm_calls(vllm, manager)
    gc.collect()
    gc.freeze()
    try:
        start = time.perf_counter()
        stats = replay_vllm_order(calls, requests, contexts, block_size=BLOCK_TOKENS)
        seconds = time.perf_counter() - start
    finally:
        gc.unfreeze()
    return seconds, stats


def headline(
    vllm: _Vllm,
    workloads: Sequence[str],
    policies: Sequence[str],
    *,
    rounds: int,
    fraction: float,
    requests: int | None,
) -> list[HeadlineRow]:
    """kvtriton through its adapter against vLLM's manager, both in vLLM's call order (module docstring)."""
    rows: list[HeadlineRow] = []
    steps = [(workload, policy) for workload in workloads for policy in policies]
    traces: dict[str, list[PreparedRequest]] = {}
    for workload, policy in progress(steps, total=len(steps), label="vLLM order"):
        if workload not in traces:
            overrides = {"requests": requests} if requests is not None else None
            traces[workload] = prepare(generate(workload, seed=0, block_size=BLOCK_TOKENS, overrides=overrides))
        trace_requests = traces[workload]
        capacity = max(1, int(_distinct_keys(trace_requests) * fraction))
        seconds: dict[str, list[float]] = {"vllm": [], "adapter": []}
        hit_rates: dict[str, float] = {}
        blocks = 0
        makers = {"vllm": vllm.make_manager, "adapter": vllm.make_adapter}
        for round_index in range(rounds):
            # Alternate which implementation goes first, so drift hits both alike.
            order = ("vllm", "adapter") if round_index % 2 == 0 else ("adapter", "vllm")
            for impl in order:
                elapsed, stats = _timed_vllm_order(makers[impl](capacity, policy), vllm, trace_requests)
                seconds[impl].append(elapsed)
                hit_rates[impl] = stats.block_hit_rate
                blocks = stats.prompt_blocks
        timings = (Timing.of(blocks, seconds[impl], hit_rates[impl]) for impl in ("vllm", "adapter"))
        rows.append(HeadlineRow(workload, policy, capacity, blocks, *timings))
    return rows


HIT_RATE_FRACTIONS = (0.05, 0.10, 0.20)
"""Capacities of the hit-rate table (and of tests/sim/test_vllm_order_parity.py), as fractions of the distinct prompt blocks."""
HIT_RATE_BLOCK_TOKENS = 64
"""Tokens per block of the hit-rate table: the parity test's, which keeps the default traces at a few thousand blocks."""


def hit_rate_table(vllm: _Vllm, workloads: Sequence[str], block_tokens: int) -> tuple[list[str], list[list[object]]]:
    """Block hit rates (%) of vLLM's manager and of kvtriton through its adapter, vLLM's call order, per workload and capacity."""
    headers = [
        "workload / slots",
        "vLLM 0.33 LRU",
        "kvtriton LRU via the adapter",
        "vLLM ARC",
        "kvtriton ARC via the adapter",
    ]
    rows: list[list[object]] = []
    for workload in progress(workloads, total=len(workloads), label="hit rates"):
        requests = prepare(generate(workload, seed=0, block_size=block_tokens))
        for fraction in HIT_RATE_FRACTIONS:
            capacity = max(1, int(_distinct_keys(requests) * fraction))
            row: list[object] = [f"{workload} / {capacity}"]
            for policy in ("lru", "arc"):
                for make in (vllm.make_manager, vllm.make_adapter):
                    calls = _vllm_calls(vllm, make(capacity, policy))
                    contexts = _vllm_contexts(vllm, requests, block_tokens)
                    stats = replay_vllm_order(calls, requests, contexts, block_size=block_tokens)
                    row.append(f"{100 * stats.block_hit_rate:.2f}%")
            rows.append(row)
    return headers, rows


def _rate(timing: Timing) -> str:
    return f"{timing.median:,.0f} ({timing.low:,.0f}-{timing.high:,.0f})"


HEADLINE_COLUMNS = (
    "workload",
    "policy",
    "slots",
    "vLLM blocks/s (range)",
    "kvtriton via adapter blocks/s (range)",
    "speed-up",
)
"""The headline table's columns up to the hit rates, here and in the docs (bench/render_docs.py)."""


def format_headline(rows: Sequence[HeadlineRow]) -> str:
    headers = [*HEADLINE_COLUMNS, "vLLM hit %", "kvtriton hit %"]
    table: list[list[object]] = [
        [
            row.workload,
            row.policy,
            row.capacity,
            _rate(row.vllm),
            _rate(row.kvtriton_via_vllm_adapter),
            f"{row.speedup:.2f}x",
            f"{100 * row.vllm.hit_rate:.2f}",
            f"{100 * row.kvtriton_via_vllm_adapter.hit_rate:.2f}",
        ]
        for row in rows
    ]
    return format_table(headers, table)


# --- the command -----------------------------------------------------------------

TRACE_SHAPE_OPTIONS = (
    ("blocks_per_request", "keys per request"),
    ("prefixes", "distinct shared prefixes"),
    ("prefix_blocks", "blocks per shared prefix"),
    ("zipf_s", "Zipf exponent of prefix popularity"),
)
"""The ``PrefixSharingParams`` fields besides ``requests`` that are options of their own (``--blocks-per-request``...),
with their help; the option's type and default are the field's."""


def build_parser() -> argparse.ArgumentParser:
    defaults = PrefixSharingParams()
    parser = bench_parser(
        "manager",
        __doc__,
        quick=f"{QUICK_REQUESTS} requests, {QUICK_HEADLINE_REQUESTS} per headline trace and one round / replay unless"
        " told otherwise; its figures judge nothing",
    )
    parser.add_argument(
        "--requests",
        type=int,
        help=f"requests in the trace (default {defaults.requests}; {QUICK_REQUESTS} with --quick)",
    )
    for field, meaning in TRACE_SHAPE_OPTIONS:
        default: int | float = getattr(defaults, field)
        option = "--" + field.replace("_", "-")
        parser.add_argument(option, type=type(default), default=default, help=f"{meaning} (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default %(default)s)")
    parser.add_argument(
        "--slots",
        type=int,
        default=8_192,
        help="cache slots of the direct-call table, a count, not a size (default %(default)s)",
    )
    parser.add_argument(
        "--inflight", type=int, default=4, help="requests whose transfers are still running (default %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, help="replays per manager; the fastest counts (default 3; 1 with --quick)"
    )
    parser.add_argument(
        "--policies", nargs="+", default=policy_names(), choices=policy_names(), help="policies to run (default: all)"
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even when it is importable")
    parser.add_argument(
        "--vllm-touch", action="store_true", help="also call touch() on vLLM (its 0.33 connector does not)"
    )
    head = parser.add_argument_group("headline (vLLM's call order; needs vLLM)")
    head.add_argument(
        "--workloads",
        nargs="+",
        default=list(VLLM_ORDER_WORKLOADS),
        choices=list(VLLM_ORDER_WORKLOADS),
        help="workloads of the headline (default: all four)",
    )
    head.add_argument(
        "--headline-requests",
        type=int,
        help=f"requests per headline trace (default: each workload's default; {QUICK_HEADLINE_REQUESTS} with --quick)",
    )
    head.add_argument(
        "--capacity-fraction",
        type=float,
        default=HEADLINE_FRACTION,
        help="headline capacity as a fraction of the trace's distinct prompt blocks (default %(default)s)",
    )
    head.add_argument(
        "--rounds", type=int, help=f"alternating timed rounds per point (default {HEADLINE_ROUNDS}; 1 with --quick)"
    )
    head.add_argument("--no-headline", action="store_true", help="skip the headline, run only the direct-call table")
    head.add_argument(
        "--hit-rates",
        action="store_true",
        help="print only the hit-rate table (vLLM's manager vs kvtriton via the adapter, vLLM's call order,"
        f" capacities {', '.join(f'{f * 100:.0f}%%' for f in HIT_RATE_FRACTIONS)} of each trace's distinct prompt blocks,"  # %% for argparse
        f" {HIT_RATE_BLOCK_TOKENS}-token blocks, as tests/sim/test_vllm_order_parity.py) and write it to <name>_hit_rates.json",
    )
    return parser


@dataclass(frozen=True, slots=True)
class _Row:
    policy: str
    kvtriton: ReplayResult
    vllm: ReplayResult | None
    adapter: ReplayResult | None
    """kvtriton driven through its vLLM adapter with vLLM's call pattern (no touch calls)."""

    def speedup_of(self, result: ReplayResult | None) -> float | None:
        """``result``'s blocks/s over vLLM's manager's (None where either was not measured)."""
        return None if result is None or self.vllm is None else result.blocks_per_s / self.vllm.blocks_per_s


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quick: bool = args.quick
    # A smoke run never overwrites a measured result (`kvtriton bench` already names it <name>-quick).
    name = result_name(args)
    repeats: int = args.repeats if args.repeats is not None else 1 if quick else 3
    capacity: int = args.slots
    inflight: int = args.inflight
    if capacity < 1 or repeats < 1 or inflight < 0:
        raise SystemExit(f"need --slots >= 1, --repeats >= 1, --inflight >= 0; got {capacity}, {repeats}, {inflight}")
    default_requests = QUICK_REQUESTS if quick else PrefixSharingParams().requests
    try:
        params = PrefixSharingParams(
            requests=args.requests if args.requests is not None else default_requests,
            **{field: getattr(args, field) for field, _ in TRACE_SHAPE_OPTIONS},
        )
    except ValueError as error:
        raise SystemExit(f"bad trace shape: {error}") from None
    seed: int = args.seed
    requests = trace(params, seed)
    distinct = _distinct_keys(requests)

    vllm = None if args.no_vllm else _load_vllm()
    if args.hit_rates:
        if not isinstance(vllm, _Vllm):
            raise SystemExit(f"--hit-rates needs vLLM: {vllm or 'skipped (--no-vllm)'}")
        headers, table_rows = hit_rate_table(vllm, args.workloads, HIT_RATE_BLOCK_TOKENS)
        print(format_table(headers, table_rows))
        path = write_json(
            f"{name}_hit_rates",
            {
                "benchmark": "manager hit rates",
                "command": command_line("manager", argv),
                "vllm": f"vLLM {vllm.version}",
                "block_size": HIT_RATE_BLOCK_TOKENS,
                "capacity_fractions": list(HIT_RATE_FRACTIONS),
                "headers": headers,
                "rows": table_rows,
            },
        )
        print(f"wrote {path}")
        return 0
    vllm_status = "skipped (--no-vllm)" if vllm is None else vllm if isinstance(vllm, str) else f"vLLM {vllm.version}"
    print(
        f"trace: {WORKLOAD} workload, {params.requests} requests x {params.blocks_per_request} blocks,"
        f" {distinct} distinct keys, capacity {capacity}"
    )
    if isinstance(vllm, str):
        print(f"vLLM not importable ({vllm}); measuring kvtriton alone")
    if quick:
        print(
            "SMOKE RUN (--quick): small traces, one round; the figures only show that the benchmark runs, not its results"
        )

    rounds: int = args.rounds if args.rounds is not None else 1 if quick else HEADLINE_ROUNDS
    fraction: float = args.capacity_fraction
    headline_requests: int | None = (
        args.headline_requests if args.headline_requests is not None else (QUICK_HEADLINE_REQUESTS if quick else None)
    )
    if rounds < 1 or not 0.0 < fraction <= 1.0 or (headline_requests is not None and headline_requests < 1):
        raise SystemExit(
            f"need --rounds >= 1, 0 < --capacity-fraction <= 1, --headline-requests >= 1;"
            f" got {rounds}, {fraction}, {headline_requests}"
        )
    head_rows: list[HeadlineRow] = []
    if isinstance(vllm, _Vllm) and not args.no_headline:
        head_rows = headline(
            vllm, args.workloads, args.policies, rounds=rounds, fraction=fraction, requests=headline_requests
        )
        print("headline: kvtriton through its vLLM adapter vs vLLM's manager, both in vLLM's call order, GC frozen;")
        print(
            f"median blocks/s (range) over {rounds} alternating round(s), capacity {fraction:g} of the distinct prompt blocks"
        )
        print(format_headline(head_rows))
        print()
        print("second table: direct calls (kvtriton's own API with touch), the prefix-sharing trace")

    ours_ctx = [ReqContext(req_id=request.req_id) for request in requests]
    policies: list[str] = args.policies
    steps = [(policy, rep) for policy in policies for rep in range(repeats)]
    replays: dict[tuple[str, str], list[ReplayResult]] = defaultdict(list)
    for policy, _ in progress(steps, total=len(steps), label="replaying"):
        # Alternate the implementations so machine noise hits both alike.
        ours = manager_calls(CPUOffloadingManager(capacity, policy))
        replays["kvtriton", policy].append(replay(ours, requests, ours_ctx, inflight))
        if isinstance(vllm, _Vllm):
            for impl, make in (("vllm", vllm.make_manager), ("adapter", vllm.make_adapter)):
                contexts = _vllm_contexts(vllm, requests, BLOCK_TOKENS)
                calls = _vllm_calls(vllm, make(capacity, policy), args.vllm_touch)
                replays[impl, policy].append(replay(calls, requests, contexts, inflight))

    best = {key: min(results, key=lambda result: result.seconds) for key, results in replays.items()}
    rows = [
        _Row(policy, best["kvtriton", policy], best.get(("vllm", policy)), best.get(("adapter", policy)))
        for policy in policies
    ]

    headers = ["policy", "kvtriton blocks/s", "kvtriton hit rate"]
    if isinstance(vllm, _Vllm):
        headers += [
            "vLLM blocks/s",
            "vLLM hit rate",
            "speed-up",
            "via adapter blocks/s",
            "via adapter hit rate",
            "adapter speed-up",
        ]
    table: list[list[object]] = []
    for row in rows:
        line: list[object] = [row.policy, row.kvtriton.blocks_per_s, row.kvtriton.hit_rate]
        if row.vllm is not None and row.adapter is not None:
            line += [row.vllm.blocks_per_s, row.vllm.hit_rate, row.speedup_of(row.kvtriton)]
            line += [row.adapter.blocks_per_s, row.adapter.hit_rate, row.speedup_of(row.adapter)]
        table.append(line)
    print(format_table(headers, table))
    simulate = simulate_command(params, seed, capacity, inflight, policies)
    print(f"same trace, window and capacity in the simulator: {simulate}")

    def record(result: ReplayResult | None) -> dict[str, object] | None:
        if result is None:
            return None
        return {**asdict(result), "blocks_per_s": result.blocks_per_s, "hit_rate": result.hit_rate}

    path = write_json(
        name,
        {
            "benchmark": "manager",
            "smoke_run": quick,
            "command": command_line("manager", argv),
            "trace": {"workload": WORKLOAD, "seed": seed, "block_size": BLOCK_TOKENS, **asdict(params)},
            "simulate": simulate,
            "distinct_keys": distinct,
            "capacity": capacity,
            "inflight": inflight,
            "repeats": repeats,
            "vllm": vllm_status,
            "vllm_touch": bool(args.vllm_touch),
            "headline": {
                "call_order": "vllm (kvtriton.sim._vllm_order, async loads, 4 arrivals and 2 decode steps per request)",
                "rounds": rounds,
                "capacity_fraction": fraction,
                "requests": headline_requests,
                "rows": [{**asdict(row), "speedup": row.speedup} for row in head_rows],
            },
            "results": [
                {
                    "policy": row.policy,
                    "kvtriton": record(row.kvtriton),
                    "vllm": record(row.vllm),
                    "speedup": row.speedup_of(row.kvtriton),
                    "kvtriton_via_vllm_adapter": record(row.adapter),
                    "adapter_speedup": row.speedup_of(row.adapter),
                }
                for row in rows
            ],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
