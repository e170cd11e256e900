"""Scheduler-side throughput: replay a prefix-sharing trace through the managers.

The trace (``prefix_sharing_trace``) mimics a serving workload: each request
starts with part of a shared prefix (system prompts, few-shot examples,
earlier turns) chosen with Zipf popularity, and ends with blocks no other
request has. Every request is replayed in the order a serving engine calls the
manager: lookup until the first miss, prepare_load the hits, touch all keys,
prepare_store the rest; ``complete_load`` / ``complete_store`` arrive
``--inflight`` requests later, as transfer jobs finish.

Prints blocks per second (trace blocks / replay seconds, best of
``--repeats``) and hit rate (blocks loaded from the cache / trace blocks) per
policy. When vLLM is importable, the same trace also runs through vLLM's
``CPUOffloadingManager`` in the same process, and the ratio is printed. vLLM
0.33 keeps its recency in per-request hooks (``on_new_request`` /
``on_request_finished``, with token positions recorded in its ``ReqContext``
by the scheduler), so its replay makes those calls too; ``--vllm-touch`` adds
the ``touch`` call its connector no longer makes.

    python -m bench.manager                         # defaults below, ~20 s here
    python -m bench.manager --requests 20000 --capacity 16384
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Generic, Protocol, TypeVar, cast

import numpy as np

from bench.common import format_table, write_json
from kvtriton.keys import OffloadKey, make_offload_key
from kvtriton.manager import CPUOffloadingManager, policy_names
from kvtriton.progress import progress
from kvtriton.specs import LookupResult, ReqContext

__all__ = [
    "ManagerCalls",
    "ReplayResult",
    "TraceConfig",
    "main",
    "prefix_sharing_trace",
    "replay",
]

VLLM_MANAGER_MODULE = "vllm.v1.kv_offload.cpu.manager"
VLLM_BASE_MODULE = "vllm.v1.kv_offload.base"
BLOCK_TOKENS = 16
"""Tokens per block, only used to give vLLM's ReqContext the key positions its scheduler would record."""


# --- the trace -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Shape of a synthetic prefix-sharing trace (defaults: the benchmark's)."""

    requests: int = 4_000
    """Requests in the trace."""
    blocks_per_request: int = 64
    """Blocks (offload keys) per request: shared prefix part + unique tail."""
    prefixes: int = 400
    """Distinct shared prefixes."""
    prefix_blocks: int = 48
    """Length of each shared prefix; a request uses the first half to all of it."""
    zipf_s: float = 1.1
    """Zipf exponent of prefix popularity (prefix of rank r has weight r**-s)."""
    seed: int = 0
    """Seed: the same config always yields the same trace."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.blocks_per_request < 1:
            raise ValueError(f"blocks_per_request must be >= 1, got {self.blocks_per_request}")
        if self.prefixes < 1:
            raise ValueError(f"prefixes must be >= 1, got {self.prefixes}")
        if not 0 <= self.prefix_blocks <= self.blocks_per_request:
            raise ValueError(f"prefix_blocks must be in 0..{self.blocks_per_request}, got {self.prefix_blocks}")
        if self.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0, got {self.zipf_s}")


def _key(tag: str) -> OffloadKey:
    # 32-byte block hashes, like vLLM's sha256 prefix-chained block hashes.
    return make_offload_key(hashlib.sha256(tag.encode()).digest(), 0)


def prefix_sharing_trace(config: TraceConfig = TraceConfig()) -> list[list[OffloadKey]]:
    """Build the requests of a trace: one list of keys per request, in prefix order.

    Request ``i`` picks prefix ``p`` with probability proportional to
    ``rank(p) ** -zipf_s`` and a shared length ``L`` uniform in
    ``[ceil(prefix_blocks / 2), prefix_blocks]``; its first ``L`` keys are
    blocks ``0..L-1`` of prefix ``p`` (identical across requests, as chained
    block hashes are) and the other ``blocks_per_request - L`` keys are new.
    Pure: depends on ``config`` only.
    """
    config.validate()
    rng = np.random.default_rng(config.seed)
    weights = np.arange(1, config.prefixes + 1, dtype=np.float64) ** -config.zipf_s
    chosen = rng.choice(config.prefixes, size=config.requests, p=weights / weights.sum())
    low = (config.prefix_blocks + 1) // 2
    shared = rng.integers(low, config.prefix_blocks + 1, size=config.requests)
    prefix_keys: dict[int, list[OffloadKey]] = {}
    requests: list[list[OffloadKey]] = []
    for i in range(config.requests):
        prefix = int(chosen[i])
        keys = prefix_keys.get(prefix)
        if keys is None:
            keys = prefix_keys[prefix] = [_key(f"p{prefix}/{b}") for b in range(config.prefix_blocks)]
        length = int(shared[i])
        tail = [_key(f"r{i}/{b}") for b in range(length, config.blocks_per_request)]
        requests.append(keys[:length] + tail)
    return requests


# --- the replay ----------------------------------------------------------------

CtxT = TypeVar("CtxT")


class StoreOutput(Protocol):
    """What the replay reads from a ``prepare_store`` answer (kvtriton's or vLLM's)."""

    @property
    def keys_to_store(self) -> list[OffloadKey]: ...


KeysCall = Callable[[list[OffloadKey], CtxT], object]


@dataclass(frozen=True, slots=True)
class ManagerCalls(Generic[CtxT]):
    """The bound methods the replay calls, so one loop drives any manager."""

    lookup: Callable[[OffloadKey, CtxT], object]
    prepare_load: KeysCall[CtxT]
    touch: KeysCall[CtxT] | None
    prepare_store: Callable[[list[OffloadKey], CtxT], StoreOutput | None]
    complete_load: KeysCall[CtxT]
    complete_store: KeysCall[CtxT]
    hit: object
    """The manager's ``LookupResult.HIT`` value."""
    on_new_request: Callable[[CtxT], object] | None = None
    on_request_finished: Callable[[CtxT], object] | None = None


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """One replay of a trace through one manager."""

    seconds: float
    blocks: int
    loaded: int
    """Blocks served from the cache (the lookup-until-miss prefix of each request)."""
    stored: int
    """Blocks ``prepare_store`` accepted."""
    failed_stores: int
    """``prepare_store`` calls answered ``None`` (no room could be made)."""

    @property
    def blocks_per_s(self) -> float:
        return self.blocks / self.seconds if self.seconds > 0 else float("inf")

    @property
    def hit_rate(self) -> float:
        return self.loaded / self.blocks if self.blocks else 0.0


def replay(
    calls: ManagerCalls[CtxT],
    requests: Sequence[list[OffloadKey]],
    contexts: Sequence[CtxT],
    inflight: int = 4,
) -> ReplayResult:
    """Replay ``requests`` (``contexts[i]`` is request ``i``'s context) and time it.

    Completions of request ``i`` are delivered after request ``i + inflight``
    has been scheduled, so loads pin blocks and stores stay pending for a
    while, as they do while transfers run.
    """
    if inflight < 0:
        raise ValueError(f"inflight must be >= 0, got {inflight}")
    if len(contexts) != len(requests):
        raise ValueError(f"contexts has {len(contexts)} entries for {len(requests)} requests")
    lookup, prepare_load, touch = calls.lookup, calls.prepare_load, calls.touch
    prepare_store, complete_load, complete_store = calls.prepare_store, calls.complete_load, calls.complete_store
    on_new, on_finished, hit = calls.on_new_request, calls.on_request_finished, calls.hit
    window: deque[tuple[list[OffloadKey], list[OffloadKey], CtxT]] = deque()
    blocks = loaded = stored = failed = 0

    def finish(job: tuple[list[OffloadKey], list[OffloadKey], CtxT]) -> None:
        hits, new, ctx = job
        if hits:
            complete_load(hits, ctx)
        if new:
            complete_store(new, ctx)
        if on_finished is not None:
            on_finished(ctx)

    start = time.perf_counter()
    for keys, ctx in zip(requests, contexts):
        if on_new is not None:
            on_new(ctx)
        n = 0
        for key in keys:
            if lookup(key, ctx) is not hit:
                break
            n += 1
        hits = keys[:n]
        if n:
            prepare_load(hits, ctx)
        if touch is not None:
            touch(keys, ctx)
        out = prepare_store(keys[n:], ctx)
        if out is None:
            failed += 1
            new: list[OffloadKey] = []
        else:
            new = out.keys_to_store
        window.append((hits, new, ctx))
        if len(window) > inflight:
            finish(window.popleft())
        blocks += len(keys)
        loaded += n
        stored += len(new)
    while window:
        finish(window.popleft())
    seconds = time.perf_counter() - start
    return ReplayResult(seconds=seconds, blocks=blocks, loaded=loaded, stored=stored, failed_stores=failed)


def kvtriton_calls(manager: CPUOffloadingManager) -> ManagerCalls[ReqContext]:
    """The replay calls of a kvtriton manager."""
    return ManagerCalls(
        lookup=manager.lookup,
        prepare_load=manager.prepare_load,
        touch=manager.touch,
        prepare_store=manager.prepare_store,
        complete_load=manager.complete_load,
        complete_store=manager.complete_store,
        hit=LookupResult.HIT,
    )


# --- vLLM, when installed --------------------------------------------------------


class _VllmContext(Protocol):
    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None: ...


class _VllmManager(Protocol):
    def lookup(self, key: OffloadKey, req_context: _VllmContext, /) -> object: ...
    def prepare_load(self, keys: list[OffloadKey], req_context: _VllmContext, /) -> object: ...
    def touch(self, keys: list[OffloadKey], req_context: _VllmContext, /) -> None: ...
    def prepare_store(self, keys: list[OffloadKey], req_context: _VllmContext, /) -> StoreOutput | None: ...
    def complete_load(self, keys: list[OffloadKey], req_context: _VllmContext, /) -> None: ...
    def complete_store(self, keys: list[OffloadKey], req_context: _VllmContext, /) -> None: ...
    def on_new_request(self, req_context: _VllmContext, /) -> object: ...
    def on_request_finished(self, req_context: _VllmContext, /) -> None: ...


@dataclass(frozen=True, slots=True)
class _Vllm:
    version: str
    make_manager: Callable[[int, str], _VllmManager]
    make_context: Callable[[str], _VllmContext]
    hit: object


def _load_vllm() -> _Vllm | str:
    """vLLM's manager pieces, or the reason they cannot be imported."""
    try:
        manager_module = importlib.import_module(VLLM_MANAGER_MODULE)
        base_module = importlib.import_module(VLLM_BASE_MODULE)
        version = str(getattr(importlib.import_module("vllm"), "__version__", "unknown"))
    except Exception as error:  # vLLM missing, or present but broken (missing optional deps)
        return f"{type(error).__name__}: {error}"
    manager_cls = cast(Callable[..., _VllmManager], manager_module.CPUOffloadingManager)
    context_cls = cast(Callable[..., _VllmContext], base_module.ReqContext)
    lookup_result = cast(type, base_module.LookupResult)

    def make_manager(capacity: int, policy: str) -> _VllmManager:
        return manager_cls(capacity, cache_policy=policy, enable_events=False)

    def make_context(req_id: str) -> _VllmContext:
        return context_cls(req_id=req_id)

    return _Vllm(version, make_manager, make_context, getattr(lookup_result, "HIT"))


def _vllm_contexts(vllm: _Vllm, requests: Sequence[list[OffloadKey]]) -> list[_VllmContext]:
    # The scheduler records each key's end-token position in the request's
    # context before calling the manager; do it here, outside the timed loop.
    contexts: list[_VllmContext] = []
    for i, keys in enumerate(requests):
        ctx = vllm.make_context(f"req-{i}")
        for b, key in enumerate(keys):
            ctx.set_offload_key_position(key, (b + 1) * BLOCK_TOKENS)
        contexts.append(ctx)
    return contexts


def vllm_calls(manager: _VllmManager, hit: object, with_touch: bool) -> ManagerCalls[_VllmContext]:
    """The replay calls of a vLLM 0.33 manager, with its per-request hooks."""
    return ManagerCalls(
        lookup=manager.lookup,
        prepare_load=manager.prepare_load,
        touch=manager.touch if with_touch else None,
        prepare_store=manager.prepare_store,
        complete_load=manager.complete_load,
        complete_store=manager.complete_store,
        hit=hit,
        on_new_request=manager.on_new_request,
        on_request_finished=manager.on_request_finished,
    )


# --- the command -----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    defaults = TraceConfig()
    parser = argparse.ArgumentParser(prog="python -m bench.manager", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=defaults.requests, help="requests in the trace (default %(default)s)")
    parser.add_argument(
        "--blocks-per-request", type=int, default=defaults.blocks_per_request, help="keys per request (default %(default)s)"
    )
    parser.add_argument("--prefixes", type=int, default=defaults.prefixes, help="distinct shared prefixes (default %(default)s)")
    parser.add_argument(
        "--prefix-blocks", type=int, default=defaults.prefix_blocks, help="blocks per shared prefix (default %(default)s)"
    )
    parser.add_argument("--zipf-s", type=float, default=defaults.zipf_s, help="Zipf exponent of prefix popularity (default %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="trace seed (default %(default)s)")
    parser.add_argument("--capacity", type=int, default=8_192, help="cache slots (default %(default)s)")
    parser.add_argument(
        "--inflight", type=int, default=4, help="requests whose transfers are still running (default %(default)s)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="replays per manager; the fastest counts (default %(default)s)")
    parser.add_argument(
        "--policies", nargs="+", default=policy_names(), choices=policy_names(), help="policies to run (default: all)"
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even when it is importable")
    parser.add_argument("--vllm-touch", action="store_true", help="also call touch() on vLLM (its 0.33 connector does not)")
    parser.add_argument("--name", default="manager", help="result file name under bench/results/ (default %(default)s)")
    return parser


@dataclass(frozen=True, slots=True)
class _Row:
    policy: str
    kvtriton: ReplayResult
    vllm: ReplayResult | None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = TraceConfig(
        requests=args.requests,
        blocks_per_request=args.blocks_per_request,
        prefixes=args.prefixes,
        prefix_blocks=args.prefix_blocks,
        zipf_s=args.zipf_s,
        seed=args.seed,
    )
    capacity: int = args.capacity
    inflight: int = args.inflight
    repeats: int = args.repeats
    if capacity < 1 or repeats < 1 or inflight < 0:
        raise SystemExit(f"need --capacity >= 1, --repeats >= 1, --inflight >= 0; got {capacity}, {repeats}, {inflight}")
    requests = prefix_sharing_trace(config)
    distinct = len({key for keys in requests for key in keys})

    vllm = None if args.no_vllm else _load_vllm()
    vllm_status = "skipped (--no-vllm)" if vllm is None else vllm if isinstance(vllm, str) else f"vLLM {vllm.version}"
    print(f"trace: {config.requests} requests x {config.blocks_per_request} blocks, {distinct} distinct keys, capacity {capacity}")
    if isinstance(vllm, str):
        print(f"vLLM not importable ({vllm}); measuring kvtriton alone")

    ours_ctx = [ReqContext(req_id="bench")] * len(requests)
    policies: list[str] = args.policies
    rows: list[_Row] = []
    steps = [(policy, rep) for policy in policies for rep in range(repeats)]
    best: dict[tuple[str, str], ReplayResult] = {}

    def keep(impl: str, policy: str, result: ReplayResult) -> None:
        previous = best.get((impl, policy))
        if previous is None or result.seconds < previous.seconds:
            best[(impl, policy)] = result

    for policy, _ in progress(steps, total=len(steps), label="replaying"):
        # Alternate the implementations so machine noise hits both alike.
        keep("kvtriton", policy, replay(kvtriton_calls(CPUOffloadingManager(capacity, policy)), requests, ours_ctx, inflight))
        if isinstance(vllm, _Vllm):
            contexts = _vllm_contexts(vllm, requests)
            manager = vllm.make_manager(capacity, policy)
            keep("vllm", policy, replay(vllm_calls(manager, vllm.hit, args.vllm_touch), requests, contexts, inflight))
    for policy in policies:
        rows.append(_Row(policy, best[("kvtriton", policy)], best.get(("vllm", policy))))

    headers = ["policy", "kvtriton blocks/s", "kvtriton hit rate"]
    if isinstance(vllm, _Vllm):
        headers += ["vLLM blocks/s", "vLLM hit rate", "speed-up"]
    table: list[list[object]] = []
    for row in rows:
        line: list[object] = [row.policy, row.kvtriton.blocks_per_s, row.kvtriton.hit_rate]
        if row.vllm is not None:
            line += [row.vllm.blocks_per_s, row.vllm.hit_rate, row.kvtriton.blocks_per_s / row.vllm.blocks_per_s]
        table.append(line)
    print(format_table(headers, table))

    def record(result: ReplayResult | None) -> dict[str, object] | None:
        if result is None:
            return None
        return {**asdict(result), "blocks_per_s": result.blocks_per_s, "hit_rate": result.hit_rate}

    path = write_json(
        args.name,
        {
            "benchmark": "manager",
            "command": " ".join(["python -m bench.manager", *(argv if argv is not None else sys.argv[1:])]),
            "trace": asdict(config),
            "distinct_keys": distinct,
            "capacity": capacity,
            "inflight": inflight,
            "repeats": repeats,
            "vllm": vllm_status,
            "vllm_touch": bool(args.vllm_touch),
            "results": [
                {
                    "policy": row.policy,
                    "kvtriton": record(row.kvtriton),
                    "vllm": record(row.vllm),
                    "speedup": None if row.vllm is None else row.kvtriton.blocks_per_s / row.vllm.blocks_per_s,
                }
                for row in rows
            ],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
