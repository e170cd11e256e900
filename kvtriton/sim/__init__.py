"""The simulator: what kvtriton's manager would do for a workload, without a GPU.

Workloads and traces, the replay of manager calls in kvtriton's order and in
vLLM's, a model of a vLLM server (its scheduler and GPU prefix cache), the
tier models behind host memory and the capacity planners over them, which
``kvtriton simulate`` and the benchmarks drive. Built on the core only;
imports neither torch nor triton (a geometry imports torch only to size a
compressed row).

This list is what leaves the room: what the command (``kvtriton.cli``), the
benchmarks (``bench/``) and the docs' examples use, grouped by what it is
for (the comments in ``__all__``). The modules behind it are private; the
tests reach them directly.
"""

from __future__ import annotations

# A fleet: engines behind a router, each with its own host tier, sharing one pool (kvtriton simulate --engines).
from kvtriton.sim._fleet import (
    POOL_KNEE_POINTS,
    EngineReport,
    FleetPoint,
    FleetRecommendation,
    PoolKnee,
    fleet_point,
    fleet_sweep,
    pool_knees,
    recommend_fleet,
)

# A model's bytes per block, and the sizes the command's flags take and print.
from kvtriton.sim._geometry import (
    GIB,
    MAX_HOST_BYTES,
    MAX_TIER_BYTES,
    PRESETS,
    ModelGeometry,
    check_host_bytes,
    check_tier_bytes,
    format_bytes,
    parse_dtype,
    size_argument,
)
from kvtriton.sim._gpu_prefix_cache import GpuPrefixCache
from kvtriton.sim._planner import (
    CALL_ORDER_ALIASES,
    CALL_ORDERS,
    COMPRESSION_EXTRA_CONFIG_KEY,
    DEFAULT_SWEEP_POINTS,
    CallOrder,
    EngineSettings,
    KvtritonOrder,
    PointReport,
    Recommendation,
    TraceSummary,
    Track,
    VllmOrder,
    default_capacities,
    recommend,
    summarize,
    sweep,
)
from kvtriton.sim._replay import (
    HookedManager,
    ManagerCalls,
    PreparedRequest,
    ReplayStats,
    StoreOutput,
    hooked_calls,
    manager_calls,
    positioned_contexts,
    prepare,
    replay_calls,
)
from kvtriton.sim._router import (
    DEFAULT_AFFINITY_BLOCKS,
    DEFAULT_ROUTER,
    ROUTERS,
    RouterName,
    route,
    split_streams,
)
from kvtriton.sim._tier_models import TIER_MODELS, TierSpec, parse_tier, tier_choices, tier_help, tier_metavar
from kvtriton.sim._tiered_planner import (
    DEFAULT_HOST_PRICE_RATIO,
    Stall,
    TieredRecommendation,
    TieredReport,
    recommend_tiered,
    sweep_requests,
    tiered_sweep,
)
from kvtriton.sim._token_trace import TokenRequest, TokenWorkloadParams, token_workload, write_trace
from kvtriton.sim._vllm_order import DEFAULT_ARRIVALS, DEFAULT_DECODE_STEPS, replay_vllm_order
from kvtriton.sim._vllm_server import (
    DEFAULT_LOAD_STEPS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_STORE_STEPS,
    MAX_DEFERRALS,
    ServerModel,
    ServerStats,
    predict,
    replay_vllm_server,
)
from kvtriton.sim._workloads import (
    VLLM_ORDER_WORKLOADS,
    WORKLOADS,
    PrefixSharingParams,
    Request,
    TraceBlockSizeMismatch,
    generate,
    read_trace,
)

__all__ = [
    # A model's bytes per block, and the sizes the command's flags take and print.
    "GIB",
    "MAX_HOST_BYTES",
    "MAX_TIER_BYTES",
    "PRESETS",
    "ModelGeometry",
    "check_host_bytes",
    "check_tier_bytes",
    "format_bytes",
    "parse_dtype",
    "size_argument",
    # Workloads: the built-in generators and trace files (the command, bench/manager.py), and the token-level
    # traces with which docs/simulate.md's fidelity example drives a real vLLM engine.
    "VLLM_ORDER_WORKLOADS",
    "WORKLOADS",
    "PrefixSharingParams",
    "Request",
    "TokenRequest",
    "TokenWorkloadParams",
    "TraceBlockSizeMismatch",
    "generate",
    "read_trace",
    "token_workload",
    "write_trace",
    # Replay over any manager, in kvtriton's call order and in vLLM's scheduler order: the loops the command
    # drives and bench/manager.py times.
    "HookedManager",
    "ManagerCalls",
    "PreparedRequest",
    "ReplayStats",
    "StoreOutput",
    "hooked_calls",
    "manager_calls",
    "positioned_contexts",
    "prepare",
    "replay_calls",
    "replay_vllm_order",
    # The model of a vLLM server (its scheduler, GPU prefix cache, asynchronous loads and stores), its defaults
    # (the command's flags) and its prediction (the docs' fidelity example).
    "DEFAULT_ARRIVALS",
    "DEFAULT_DECODE_STEPS",
    "DEFAULT_LOAD_STEPS",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_STORE_STEPS",
    "GpuPrefixCache",
    "MAX_DEFERRALS",
    "ServerModel",
    "ServerStats",
    "predict",
    "replay_vllm_server",
    # The host-memory planner: sizes and policies swept in either call order, and the answer's vLLM config.
    "CALL_ORDERS",
    "CALL_ORDER_ALIASES",
    "COMPRESSION_EXTRA_CONFIG_KEY",
    "DEFAULT_SWEEP_POINTS",
    "CallOrder",
    "EngineSettings",
    "KvtritonOrder",
    "PointReport",
    "Recommendation",
    "TraceSummary",
    "Track",
    "VllmOrder",
    "default_capacities",
    "recommend",
    "summarize",
    "sweep",
    # The tier models behind host memory (the registry: one entry a backend, --tier's choices and help) and the
    # planner across both tiers.
    "TIER_MODELS",
    "TierSpec",
    "parse_tier",
    "tier_choices",
    "tier_help",
    "tier_metavar",
    "DEFAULT_HOST_PRICE_RATIO",
    "Stall",
    "TieredRecommendation",
    "TieredReport",
    "recommend_tiered",
    "sweep_requests",
    "tiered_sweep",
    # A fleet: N engines behind a router (round-robin or prefix-affinity), each with its own host tier, sharing
    # one Mooncake pool; its points per engine and the pool size past which a larger pool stops paying.
    "DEFAULT_AFFINITY_BLOCKS",
    "DEFAULT_ROUTER",
    "POOL_KNEE_POINTS",
    "ROUTERS",
    "EngineReport",
    "FleetPoint",
    "FleetRecommendation",
    "PoolKnee",
    "RouterName",
    "fleet_point",
    "fleet_sweep",
    "pool_knees",
    "recommend_fleet",
    "route",
    "split_streams",
]
