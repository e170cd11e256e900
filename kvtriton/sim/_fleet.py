"""A fleet: N vLLM engines behind a router, each with its own GPU prefix cache and host tier, sharing one pool.

``kvtriton simulate --engines N`` routes one trace to N engines
(:mod:`kvtriton.sim._router`) and replays the engines in lockstep through the
single-engine model, unchanged: each engine is the server model of
:mod:`kvtriton.sim._vllm_server` with its own GPU prefix cache, and its
connector is a :class:`~kvtriton.sim._secondary_tier.TieredManager` over its
own host tier, every manager in front of the one shared pool (a
:class:`~kvtriton.sim._secondary_tier.MooncakePool`, capacity-limited, its
master's eviction rule). A prefix one engine cascades into the pool is a pool
hit for every other engine that asks for it later. A fleet of one engine is
the single-engine tiered point exactly (:func:`kvtriton.sim._tiered_planner.replay_tiered`).

:func:`fleet_sweep` runs every (policy, host size, pool size) point;
:func:`pool_knees` reads, per (policy, host size), the pool size at which
adding memory stops paying: the smallest pool whose hit share is within
:data:`POOL_KNEE_POINTS` of the largest pool tried (see :class:`PoolKnee`).

What the engines do not share is each one's arrival pattern: the server
model's arrivals apply to each engine's own stream (``concurrency:4`` is four
requests in flight at every engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import ReqContext
from kvtriton.sim._geometry import ModelGeometry
from kvtriton.sim._planner import VllmOrder
from kvtriton.sim._replay import ManagerCalls, PreparedRequest, StoreOutput
from kvtriton.sim._router import RouterName
from kvtriton.sim._secondary_tier import TieredManager, tiered_calls
from kvtriton.sim._tier_models import TierSpec
from kvtriton.sim._tiered_planner import TieredReport, recommend_tiered, replay_tiered
from kvtriton.sim._vllm_server import ServerStats, ServerStream

POOL_KNEE_POINTS = 1.0
"""A pool size stops paying once its hit share is within this many percentage points of the largest pool tried."""


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One engine of a fleet point: what it was routed and where its prompt tokens came from."""

    engine: int
    requests: int
    prompt_tokens: int
    gpu_hit_tokens: int
    """Served by the engine's own GPU prefix cache."""
    host_hit_tokens: int
    """Loaded from chunks its host tier held (vLLM's ``prompt_tokens_cached_by_source`` ``host``)."""
    pool_hit_tokens: int
    """Loaded from chunks promoted from the shared pool for the request (that counter's pool source)."""
    external_query_tokens: int
    """Prompt tokens after the GPU hit: vLLM's ``external_prefix_cache_queries``."""
    computed_tokens: int
    """Prompt tokens the engine computed: neither its GPU cache nor a load served them."""
    promoted_chunks: int
    """Chunks it read from the pool."""
    cascaded_chunks: int
    """Chunks it wrote to the pool."""
    steps: int

    @classmethod
    def of(cls, engine: int, stats: ServerStats, manager: TieredManager, block_size: int) -> EngineReport:
        counts = manager.counts()
        return cls(
            engine=engine,
            requests=len(stats.outcomes),
            prompt_tokens=stats.prompt_tokens,
            gpu_hit_tokens=stats.gpu_hit_tokens,
            host_hit_tokens=counts.host_loaded_chunks * block_size,
            pool_hit_tokens=counts.tier_loaded_chunks * block_size,
            external_query_tokens=stats.external_query_tokens,
            computed_tokens=stats.prompt_tokens - stats.gpu_hit_tokens - stats.external_hit_tokens,
            promoted_chunks=counts.promotions,
            cascaded_chunks=counts.cascaded_chunks,
            steps=stats.steps,
        )

    @property
    def hit_share(self) -> float:
        """Share of its prompt tokens it did not compute (GPU cache, host tier or pool)."""
        return 1.0 - self.computed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class FleetPoint:
    """One (policy, host size per engine, pool size) point of a fleet: the fleet's totals and each engine's."""

    router: RouterName
    affinity_blocks: int | None
    """The prefix-affinity router's K (None for a router that reads no prefix)."""
    report: TieredReport
    """The fleet's totals as the tiered planner reports a point (``servers`` is the engine count): its table rows,
    its cost and the answer's configuration come from it."""
    engines: tuple[EngineReport, ...]
    """Per engine, in engine order (empty when the point stalled: the replay stopped)."""

    @property
    def policy(self) -> str:
        return self.report.policy

    @property
    def host_bytes(self) -> int:
        return self.report.host_bytes

    @property
    def pool(self) -> TierSpec:
        return self.report.tier

    @property
    def stalled(self) -> bool:
        return self.report.stalled

    def _total(self, name: str) -> int:
        return sum(int(getattr(engine, name)) for engine in self.engines)

    @property
    def prompt_tokens(self) -> int:
        return self._total("prompt_tokens")

    @property
    def gpu_hit_tokens(self) -> int:
        return self._total("gpu_hit_tokens")

    @property
    def host_hit_tokens(self) -> int:
        return self._total("host_hit_tokens")

    @property
    def pool_hit_tokens(self) -> int:
        return self._total("pool_hit_tokens")

    @property
    def computed_tokens(self) -> int:
        return self._total("computed_tokens")

    @property
    def hit_share(self) -> float:
        """Share of the fleet's prompt tokens no engine computed (GPU caches, host tiers, pool): what
        :func:`pool_knees` compares across pool sizes."""
        prompt = self.prompt_tokens
        return 1.0 - self.computed_tokens / prompt if prompt else 0.0

    def share(self, tokens: int) -> float:
        """``tokens`` as a share of the fleet's prompt tokens."""
        prompt = self.prompt_tokens
        return tokens / prompt if prompt else 0.0


class _Contexts(Sequence[ReqContext]):
    """Each request's context, made when the replay first asks for it and let go once it never will again.

    ``positioned_contexts`` makes every context up front, and each one ends up holding a position per prompt
    block and the manager's record of the request (kept in the context): about 10 KiB a request that a
    million-request fleet would hold to the end. Here a context is made at its request's arrival, the same
    object is returned for the request's whole life, and it is dropped once the request finished and its last
    store completed (:meth:`calls` wraps the manager calls that say so): the replay asks for a request's
    context only up to then, and the manager's own tier jobs hold their reference for as long as they run.
    """

    def __init__(self, requests: Sequence[PreparedRequest], block_size: int) -> None:
        self._requests = requests
        self._block_size = block_size
        self._made: dict[int, ReqContext] = {}
        self._index_of: dict[str, int] = {}
        self._pending_stores: dict[str, int] = {}
        self._finished: set[str] = set()

    def __len__(self) -> int:
        return len(self._requests)

    @overload
    def __getitem__(self, index: int) -> ReqContext: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[ReqContext]: ...
    def __getitem__(self, index: int | slice) -> ReqContext | Sequence[ReqContext]:
        if isinstance(index, slice):
            return [self[each] for each in range(*index.indices(len(self)))]
        made = self._made.get(index)
        if made is None:
            request = self._requests[index]
            if request.req_id in self._finished:
                raise RuntimeError(f"request {request.req_id!r}'s context was asked for after it was let go")
            made = ReqContext(req_id=request.req_id)
            block_size = self._block_size
            made.key_positions.update(
                (key, (position + 1) * block_size) for position, key in enumerate(request.prompt_keys)
            )
            self._made[index] = made
            self._index_of[request.req_id] = index
        return made

    def __iter__(self) -> Iterator[ReqContext]:
        return (self[index] for index in range(len(self)))

    def calls(self, calls: ManagerCalls[ReqContext]) -> ManagerCalls[ReqContext]:
        """``calls``, telling this sequence when each request finishes and when its stores complete."""
        prepare_store, complete_store, on_finished = (
            calls.prepare_store,
            calls.complete_store,
            calls.on_request_finished,
        )
        pending = self._pending_stores

        def prepare(keys: Sequence[OffloadKey], context: ReqContext) -> StoreOutput | None:
            output = prepare_store(keys, context)
            if output is not None and output.keys_to_store:  # the replay then runs a store job, completed later
                pending[context.req_id] = pending.get(context.req_id, 0) + 1
            return output

        def complete(keys: Sequence[OffloadKey], context: ReqContext) -> None:
            complete_store(keys, context)
            left = pending[context.req_id] - 1
            if left:
                pending[context.req_id] = left
            else:
                del pending[context.req_id]
                self._let_go(context.req_id)

        def finished(context: ReqContext) -> None:
            if on_finished is not None:
                on_finished(context)
            self._finished.add(context.req_id)
            self._let_go(context.req_id)

        return dataclasses.replace(calls, prepare_store=prepare, complete_store=complete, on_request_finished=finished)

    def _let_go(self, req_id: str) -> None:
        if req_id in self._finished and req_id not in self._pending_stores:
            self._made.pop(self._index_of.pop(req_id), None)


def fleet_point(
    streams: Sequence[Sequence[PreparedRequest]],
    geometry: ModelGeometry,
    host_bytes: int,
    pool: TierSpec,
    policy: str,
    order: VllmOrder,
    *,
    router: RouterName,
    affinity_blocks: int | None = None,
    on_finished: Callable[[int], None] | None = None,
) -> FleetPoint:
    """One point: engine ``i`` replays ``streams[i]`` behind its own host tier of ``host_bytes``, all in front of one
    fresh ``pool``. ``on_finished`` counts requests as they finish (a stalled point reports the rest at once)."""

    def server_streams(managers: Sequence[TieredManager]) -> list[ServerStream[ReqContext]]:
        contexts = [_Contexts(requests, geometry.block_size) for requests in streams]
        return [
            ServerStream(each.calls(tiered_calls(manager)), requests, each)
            for manager, requests, each in zip(managers, streams, contexts)
        ]

    replay = replay_tiered(
        streams, geometry, host_bytes, pool, policy, order, server_streams=server_streams, on_finished=on_finished
    )
    engines = tuple(
        EngineReport.of(index, each, manager, geometry.block_size)
        for index, (each, manager) in enumerate(zip(replay.stats, replay.managers))
    )
    return FleetPoint(router, affinity_blocks, replay.report, engines)


def fleet_sweep(
    streams: Sequence[Sequence[PreparedRequest]],
    geometry: ModelGeometry,
    host_capacities: Sequence[int],
    pools: Sequence[TierSpec],
    policies: Sequence[str],
    order: VllmOrder,
    *,
    router: RouterName,
    affinity_blocks: int | None = None,
    on_finished: Callable[[int], None] | None = None,
) -> list[FleetPoint]:
    """Every (policy, host size, pool size) point, each on fresh engines and a fresh pool, in that order."""
    return [
        fleet_point(
            streams,
            geometry,
            host,
            pool,
            policy,
            order,
            router=router,
            affinity_blocks=affinity_blocks,
            on_finished=on_finished,
        )
        for policy in policies
        for host in host_capacities
        for pool in pools
    ]


@dataclass(frozen=True, slots=True)
class PoolKnee:
    """Where adding pool memory stops paying, for one (policy, host size per engine).

    ``knee`` is the smallest pool whose :attr:`FleetPoint.hit_share` is within ``within_points`` percentage
    points of ``largest``'s, the largest pool tried: a larger pool than ``knee`` buys less than that. Stalled
    points are skipped. The knee is only as good as the sizes tried: when it is the largest, a larger pool may
    still pay (``at_largest``).
    """

    policy: str
    host_bytes: int
    within_points: float
    knee: FleetPoint | None
    """None when every point of the pair stalled."""
    largest: FleetPoint | None

    @property
    def at_largest(self) -> bool:
        """The knee is the largest pool tried, so the sweep does not show where adding memory stops paying."""
        return self.knee is not None and self.knee is self.largest and self.knee.pool.capacity_bytes is not None


def pool_knees(points: Sequence[FleetPoint], within_points: float = POOL_KNEE_POINTS) -> list[PoolKnee]:
    """:class:`PoolKnee` per (policy, host size), in the order the points first name them."""
    if not within_points >= 0:
        raise ValueError(f"within_points must be >= 0 percentage points, got {within_points!r}")
    pairs = dict.fromkeys((point.policy, point.host_bytes) for point in points)
    knees: list[PoolKnee] = []
    for policy, host in pairs:
        ran = sorted(
            (p for p in points if (p.policy, p.host_bytes) == (policy, host) and not p.stalled),
            key=lambda p: p.pool.capacity_bytes or 0,
        )
        if not ran:
            knees.append(PoolKnee(policy, host, within_points, None, None))
            continue
        largest = ran[-1]
        # 1e-9: shares are ratios of token counts, so the bound must not lose a point to rounding.
        knee = next(p for p in ran if 100 * (largest.hit_share - p.hit_share) <= within_points + 1e-9)
        knees.append(PoolKnee(policy, host, within_points, knee, largest))
    return knees


@dataclass(frozen=True, slots=True)
class FleetRecommendation:
    """The cheapest fleet point whose hit share reaches the target, and the configuration every engine starts with."""

    target: float
    """A hit share: the share of the fleet's prompt tokens no engine computes."""
    host_price_ratio: float
    point: FleetPoint | None
    """None when no point tried reaches the target."""
    best: FleetPoint
    """The point with the highest hit share (the closest one when none reaches the target)."""
    extra_config: dict[str, object] | None
    """Every engine's ``kv_connector_extra_config`` (they differ in nothing: one pool, one host size, one policy)."""


def recommend_fleet(
    points: Sequence[FleetPoint],
    target: float,
    host_price_ratio: float,
    geometry: ModelGeometry,
    *,
    server: VllmOrder | None = None,
) -> FleetRecommendation:
    """The point of least cost (every engine's host memory at ``host_price_ratio`` times a pool GiB, plus the pool)
    whose :attr:`FleetPoint.hit_share` reaches ``target`` (then the higher share).

    The fleet's target is a hit share, not the rate vLLM reports: that rate counts only the tokens each engine's
    GPU cache did not serve, so a router that makes the GPU caches hit (prefix-affinity) would look worse by it
    while computing less.
    """
    if not points:
        raise ValueError("no fleet points to choose from")
    if not host_price_ratio > 0:
        raise ValueError(f"host_price_ratio must be positive, got {host_price_ratio!r}")
    usable = [point for point in points if not point.stalled] or list(points)
    best = max(usable, key=lambda point: (point.hit_share, -point.report.cost(host_price_ratio)))
    reaching = [point for point in usable if not point.stalled and point.hit_share >= target - 1e-12]
    if not reaching:
        return FleetRecommendation(target, host_price_ratio, None, best, None)
    chosen = min(reaching, key=lambda point: (point.report.cost(host_price_ratio), -point.hit_share))
    # The configuration is the tiered planner's for that one point: one rule for the spec's keys.
    config = recommend_tiered([chosen.report], 0.0, host_price_ratio, geometry, server=server).extra_config
    return FleetRecommendation(target, host_price_ratio, chosen, best, config)
