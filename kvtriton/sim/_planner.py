"""The capacity planner: a trace swept over host sizes and policies, each point reported and the answer chosen.

:func:`sweep` replays a trace once per (policy, capacity) in one of the two
call orders (:class:`KvtritonOrder`, :class:`VllmOrder`); :class:`PointReport`
turns a point's counts into rates, bytes and seconds; :func:`recommend` picks
the smallest size that reaches a target and writes the vLLM configuration for
it. ``kvtriton simulate`` is the command over these.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvtriton._int_argument import check_int
from kvtriton._keys import OffloadKey
from kvtriton._offload_types import ReqContext
from kvtriton.manager import CPUOffloadingManager
from kvtriton.sim._geometry import GIB, ModelGeometry, format_bytes
from kvtriton.sim._replay import PreparedRequest, ReplayStats, positioned_contexts, replay, vllm_order_calls
from kvtriton.sim._vllm_order import DEFAULT_DECODE_STEPS
from kvtriton.sim._vllm_server import (
    DEFAULT_LOAD_STEPS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_STORE_STEPS,
    ServerModel,
    ServerStats,
    replay_vllm_server,
)

DEFAULT_SWEEP_POINTS = 8
"""Capacities a sweep tries when none are given."""


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One (policy, capacity) point of a sweep."""

    policy: str
    capacity_bytes: int
    num_blocks: int
    stats: ReplayStats
    server: ServerStats | None = None
    """The vLLM order's server-side counts (None in kvtriton's order)."""


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


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The vLLM engine settings a replay modelled, each field named as vLLM's ``EngineArgs`` names it.

    :meth:`flags` writes every setting as the ``vllm serve`` flag that sets it, given or defaulted, so that the
    server the printed line starts is the one the replay modelled whatever vLLM's own defaults are on the
    machine (they depend on the GPU). None: the call order modelled no such thing (kvtriton's order models no
    scheduler), and the flag is left out.
    """

    block_size: int
    """Tokens per block: the offloaded block and vLLM's GPU block alike (one GPU block per offloaded block)."""
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool | None = None
    """The model splits a prompt over steps within the token budget."""
    enable_prefix_caching: bool | None = None
    """The engine's own GPU prefix cache (on with ``--gpu-blocks``)."""
    num_gpu_blocks_override: int | None = None
    """The GPU KV cache in blocks (``--gpu-blocks``); None with the prefix cache off: no GPU block limit is modelled."""
    async_scheduling: bool | None = None
    """The model is vLLM's synchronous scheduler (False): asynchronous scheduling shifts loads and stores a step."""

    def flags(self) -> list[str]:
        """The ``vllm serve`` flags that set these settings, in field order."""
        flags: list[str] = []
        for field in dataclasses.fields(self):
            value: object = getattr(self, field.name)
            flag = "--" + field.name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + flag.removeprefix("--"))
            elif value is not None:
                flags.append(f"{flag} {value}")
        return flags


CALL_ORDERS = ("kvtriton", "vllm")
"""``kvtriton``: request by request with ``touch`` (:class:`KvtritonOrder`); ``vllm``: vLLM's connector (:class:`VllmOrder`)."""
CALL_ORDER_ALIASES = {"engine": "kvtriton"}
"""Earlier documented names of a call order: ``engine`` was kvtriton's own order."""


@dataclass(frozen=True, slots=True)
class KvtritonOrder:
    """kvtriton's own call order: request by request with ``touch`` (:func:`kvtriton.sim._replay.replay`)."""

    name: ClassVar[str] = "kvtriton"
    in_flight: int = 1
    """Requests admitted before the oldest completes its loads and stores."""

    def __post_init__(self) -> None:
        check_int("in_flight", self.in_flight, minimum=1)

    def replay(
        self, requests: Sequence[PreparedRequest], manager: CPUOffloadingManager, block_size: int
    ) -> tuple[ReplayStats, ServerStats | None]:
        return replay(requests, manager, block_size=block_size, in_flight=self.in_flight), None

    def engine_settings(self, block_size: int, tensor_parallel_size: int) -> EngineSettings:
        """Only the block size and the parallelism: this order models no vLLM scheduler."""
        return EngineSettings(block_size, tensor_parallel_size)


@dataclass(frozen=True, slots=True)
class VllmOrder:
    """vLLM's connector order, step by step, behind a model of the server (:mod:`kvtriton.sim._vllm_server`)."""

    name: ClassVar[str] = "vllm"
    arrivals: int | None = None
    """New requests arriving per step (None: all at once, or one at a time with ``sequential``)."""
    sequential: bool = False
    """Each request arrives the step after the previous one finished (its stores may be in flight)."""
    concurrency: int | None = None
    """The client keeps this many requests in flight (``vllm bench serve --max-concurrency``)."""
    request_rate: float | None = None
    """Poisson arrivals, this many requests per scheduler step on average (``vllm bench serve --request-rate``)."""
    arrival_seed: int = 0
    """Seeds the Poisson arrivals' gaps."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    """vLLM's ``--max-num-seqs``: at most ``max_num_batched_tokens``, as vLLM requires."""
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    """vLLM's ``--max-num-batched-tokens``."""
    gpu_blocks: int | None = None
    """The server's GPU KV cache in blocks, its prefix cache on (None: off)."""
    decode_steps: int = DEFAULT_DECODE_STEPS
    """Tokens each request generates (steps from its prompt to its end)."""
    load_steps: int = DEFAULT_LOAD_STEPS
    """A load is reported done at the end of step ``s + load_steps - 1``."""
    store_steps: int = DEFAULT_STORE_STEPS
    """A store prepared at step ``s`` completes at the end of step ``s + store_steps``."""
    sync_loads: bool = False
    """A loading request computes in the step of its load instead of the next."""

    def __post_init__(self) -> None:
        self.server_model()  # checks the knobs
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs={self.max_num_seqs} is more than max_num_batched_tokens={self.max_num_batched_tokens},"
                " which vLLM refuses (every running request takes at least one token a step)"
            )

    def engine_settings(self, block_size: int, tensor_parallel_size: int) -> EngineSettings:
        """What the server model runs with, as the ``vllm serve`` flags that start that server."""
        return EngineSettings(
            block_size,
            tensor_parallel_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=True,
            enable_prefix_caching=self.gpu_blocks is not None,
            num_gpu_blocks_override=self.gpu_blocks,
            async_scheduling=False,
        )

    def connector_settings(self, host_bytes: int, geometry: ModelGeometry) -> dict[str, object]:
        """The ``kv_connector_extra_config`` keys of vLLM's connector the model ran with, for ``host_bytes``.

        With ``sync_loads`` the model loads without limit: ``sync_load_budget_bytes`` is set where no step reaches
        it, every one of ``max_num_seqs`` new requests loading the whole host tier (as GPU bytes).
        """
        if not self.sync_loads:
            return {}
        host_tier_gpu_bytes = max(geometry.blocks_for(host_bytes), 1) * geometry.bytes_per_block
        return {"sync_load_budget_bytes": self.max_num_seqs * host_tier_gpu_bytes}

    def server_model(self) -> ServerModel:
        return ServerModel(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            gpu_blocks=self.gpu_blocks,
            arrivals=self.arrivals,
            sequential=self.sequential,
            concurrency=self.concurrency,
            request_rate=self.request_rate,
            arrival_seed=self.arrival_seed,
            output_tokens=self.decode_steps,
            load_steps=self.load_steps,
            store_steps=self.store_steps,
            sync_loads=self.sync_loads,
        )

    def replay(
        self, requests: Sequence[PreparedRequest], manager: CPUOffloadingManager, block_size: int
    ) -> tuple[ReplayStats, ServerStats | None]:
        contexts = positioned_contexts(requests, lambda req_id: ReqContext(req_id=req_id), block_size=block_size)
        server = replay_vllm_server(
            vllm_order_calls(manager), requests, contexts, block_size=block_size, model=self.server_model()
        )
        return server.replay, server


CallOrder = KvtritonOrder | VllmOrder
"""How the manager is called: one of the two orders, each with its own knobs."""

Track = Callable[[Sequence[tuple[str, int]]], Iterable[tuple[str, int]]]
"""Wraps a sweep's (policy, capacity) grid as it is replayed (the command draws a progress bar with it)."""


def sweep(
    requests: Sequence[PreparedRequest],
    geometry: ModelGeometry,
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    order: CallOrder | None = None,
    track: Track | None = None,
) -> list[SweepPoint]:
    """Replay ``requests`` once per (policy, capacity), each on a fresh manager.

    ``order`` picks the call order (default: kvtriton's, one request in flight).
    """
    call_order = order if order is not None else KvtritonOrder()
    for capacity in capacities:
        if geometry.blocks_for(capacity) < 1:
            raise ValueError(
                f"capacity {format_bytes(capacity)} holds no block of {format_bytes(geometry.stored_bytes_per_block)}"
            )
    grid = [(policy, capacity) for policy in policies for capacity in capacities]
    points: list[SweepPoint] = []
    for policy, capacity in grid if track is None else track(grid):
        num_blocks = geometry.blocks_for(capacity)
        manager = CPUOffloadingManager(num_blocks, cache_policy=policy)
        stats, server = call_order.replay(requests, manager, geometry.block_size)
        points.append(SweepPoint(policy, capacity, num_blocks, stats, server))
    return points


@dataclass(frozen=True, slots=True)
class PointReport:
    """One sweep point as reported: the replay counts turned into rates (fractions of 1), bytes and seconds."""

    policy: str
    capacity_gib: float
    capacity_bytes: int
    num_blocks: int
    block_hit_rate: float
    """Prompt blocks loaded from host memory, over all prompt blocks."""
    token_hit_rate: float
    """Prompt tokens loaded from host memory, over all prompt tokens (the offload tier's share)."""
    external_hit_rate: float
    """What vLLM reports: tokens loaded from host memory over the tokens the GPU prefix cache did not serve."""
    gpu_share: float
    """Prompt tokens served by the server's GPU prefix cache (0 without --gpu-blocks)."""
    offload_share: float
    """Prompt tokens loaded from host memory (equal to token_hit_rate)."""
    computed_share: float
    """Prompt tokens the server computed."""
    hit_blocks: int
    hit_tokens: int
    gpu_hit_tokens: int
    external_query_tokens: int
    external_hit_tokens: int
    bytes_loaded: int
    bytes_stored: int
    blocks_stored: int
    evictions: int
    refused_stores: int
    refused_blocks: int
    pending_stops: int
    load_seconds: float
    store_seconds: float
    gpu_evictions: int | None
    """vLLM order: GPU-cached blocks reused for other tokens."""
    max_admitted_per_step: int | None
    """vLLM order: the most requests admitted in one scheduler step."""
    mean_admitted_per_step: float | None
    """vLLM order: requests admitted per step, over the steps that admitted any."""
    steps: int | None
    """vLLM order: scheduler steps the trace took."""
    preemptions: int | None
    """vLLM order: running requests preempted for want of free GPU blocks."""
    compression: str = "none"
    """How host memory stored the blocks at this point: ``none`` or ``fp8-e4m3`` (bytes moved are its rows)."""

    @classmethod
    def of(cls, point: SweepPoint, geometry: ModelGeometry, bandwidth_gbps: float) -> PointReport:
        stats, server = point.stats, point.server
        bytes_loaded = stats.hit_blocks * geometry.stored_bytes_per_block
        bytes_stored = stats.blocks_stored * geometry.stored_bytes_per_block
        return cls(
            policy=point.policy,
            capacity_gib=point.capacity_bytes / GIB,
            capacity_bytes=point.capacity_bytes,
            num_blocks=point.num_blocks,
            block_hit_rate=stats.block_hit_rate,
            token_hit_rate=stats.token_hit_rate,
            external_hit_rate=server.external_hit_rate if server is not None else stats.token_hit_rate,
            gpu_share=server.gpu_share if server is not None else 0.0,
            offload_share=stats.token_hit_rate,
            computed_share=server.computed_share if server is not None else 1.0 - stats.token_hit_rate,
            hit_blocks=stats.hit_blocks,
            hit_tokens=stats.hit_tokens,
            gpu_hit_tokens=server.gpu_hit_tokens if server is not None else 0,
            external_query_tokens=server.external_query_tokens if server is not None else stats.prompt_tokens,
            external_hit_tokens=stats.hit_tokens,
            bytes_loaded=bytes_loaded,
            bytes_stored=bytes_stored,
            blocks_stored=stats.blocks_stored,
            evictions=stats.evictions,
            refused_stores=stats.refused_stores,
            refused_blocks=stats.refused_blocks,
            pending_stops=stats.pending_stops,
            load_seconds=bytes_loaded / (bandwidth_gbps * 1e9),
            store_seconds=bytes_stored / (bandwidth_gbps * 1e9),
            gpu_evictions=server.gpu_evictions if server is not None else None,
            max_admitted_per_step=server.max_admitted_per_step if server is not None else None,
            mean_admitted_per_step=server.mean_admitted_per_step if server is not None else None,
            steps=server.steps if server is not None else None,
            preemptions=server.preemptions if server is not None else None,
            compression=geometry.compression,
        )

    def rate(self, order: str) -> float:
        """The hit rate the target is checked against: vLLM's reported rate in its order, the token hit rate otherwise."""
        return self.external_hit_rate if order == "vllm" else self.token_hit_rate


SPEC_EXTRA_CONFIG: dict[str, object] = {
    "spec_name": "KVTritonOffloadingSpec",
    "spec_module_path": "kvtriton.integrations.vllm",
}
"""The keys that point vLLM's OffloadingConnector at kvtriton (docs/vllm.md)."""

COMPRESSION_EXTRA_CONFIG_KEY = "kvtriton_kv_compression"
"""The ``kv_connector_extra_config`` key of kvtriton's slab row compression (``none`` or ``fp8-e4m3``)."""


def host_extra_config(
    spec: dict[str, object], host_bytes: int, policy: str, geometry: ModelGeometry
) -> dict[str, object]:
    """``kv_connector_extra_config``: kvtriton's ``spec`` keys, a host tier of ``host_bytes``, its ``policy``."""
    extra: dict[str, object] = {**spec, "cpu_bytes_to_use": host_bytes, "eviction_policy": policy}
    if geometry.compression != "none":
        extra[COMPRESSION_EXTRA_CONFIG_KEY] = geometry.compression
    return extra


@dataclass(frozen=True, slots=True)
class Recommendation:
    """The smallest sweep point that reaches the target hit rate, as vLLM configuration."""

    target: float
    rate_name: str
    point: PointReport | None
    """None when no size tried reaches the target."""
    best: PointReport
    """The point with the highest rate (the closest one when none reaches the target)."""
    extra_config: dict[str, object] | None
    """``kv_connector_extra_config`` for ``point``."""
    kv_transfer_config: dict[str, object] | None
    """vLLM's whole ``--kv-transfer-config`` value for ``point``."""
    slab_bytes_per_rank: int | None
    """What each worker process pins (host RAM must hold it; RLIMIT_MEMLOCK does not limit it)."""
    tensor_parallel_size: int


def recommend(
    reports: Sequence[PointReport],
    target: float,
    order: str,
    geometry: ModelGeometry,
    *,
    tensor_parallel_size: int = 1,
    server: VllmOrder | None = None,
) -> Recommendation:
    """The smallest capacity (then the higher rate) whose rate reaches ``target`` (see :meth:`PointReport.rate`).

    ``server``: the server model the points ran behind, whose connector settings the config carries.
    """
    if not reports:
        raise ValueError("no sweep points to choose from")
    rate_name = "the hit rate vLLM reports" if order == "vllm" else "the token hit rate"
    best = max(reports, key=lambda report: (report.rate(order), -report.capacity_bytes))
    reaching = [report for report in reports if report.rate(order) >= target - 1e-12]
    if not reaching:
        return Recommendation(target, rate_name, None, best, None, None, None, tensor_parallel_size)
    point = min(reaching, key=lambda report: (report.capacity_bytes, -report.rate(order)))
    extra = host_extra_config(SPEC_EXTRA_CONFIG, point.capacity_bytes, point.policy, geometry)
    if server is not None:
        extra.update(server.connector_settings(point.capacity_bytes, geometry))
    transfer: dict[str, object] = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    # kvtriton's spec: each rank holds cpu_bytes_to_use // tp, in whole slots of its share of a (stored) block.
    rank_block = max(geometry.stored_bytes_per_block // tensor_parallel_size, 1)
    slab = (point.capacity_bytes // tensor_parallel_size) // rank_block * rank_block
    return Recommendation(target, rate_name, point, best, extra, transfer, slab, tensor_parallel_size)
