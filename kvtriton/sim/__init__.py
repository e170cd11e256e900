"""The simulator: what kvtriton's manager would do for a workload, without a GPU.

Workloads and traces, the replay of manager calls in kvtriton's order and in
vLLM's, a model of a vLLM server (its scheduler and GPU prefix cache) and the
capacity planner over them, which ``kvtriton simulate`` and the benchmarks
drive. Built on the core only; imports neither torch nor triton (a geometry
imports torch only to size a compressed row).

This list is what the command, the benchmarks and the docs' examples use;
the modules behind it are private.
"""

from __future__ import annotations

from kvtriton.sim._geometry import (
    GIB,
    PRESETS,
    SIZE_RULE,
    KVDtype,
    ModelGeometry,
    format_bytes,
    parse_capacity,
    parse_dtype,
    size_argument,
)
from kvtriton.sim._gpu_prefix_cache import GpuPrefixCache
from kvtriton.sim._planner import (
    CALL_ORDER_ALIASES,
    CALL_ORDERS,
    COMPRESSION_EXTRA_CONFIG_KEY,
    DEFAULT_SWEEP_POINTS,
    SPEC_EXTRA_CONFIG,
    CallOrder,
    KvtritonOrder,
    PointReport,
    Recommendation,
    SweepPoint,
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
    PositionedContext,
    PreparedRequest,
    ReplayStats,
    StoreOutput,
    hooked_calls,
    manager_calls,
    positioned_contexts,
    prepare,
    replay,
    replay_calls,
    vllm_order_calls,
)
from kvtriton.sim._token_trace import TokenRequest, TokenWorkloadParams, block_hashes, token_workload, write_trace
from kvtriton.sim._vllm_order import DEFAULT_ARRIVALS, DEFAULT_DECODE_STEPS, replay_vllm_order, vllm_order
from kvtriton.sim._vllm_server import (
    DEFAULT_LOAD_STEPS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_OUTPUT_TOKENS,
    DEFAULT_STORE_STEPS,
    RequestOutcome,
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
    Workload,
    generate,
    parse_trace,
    read_trace,
)

__all__ = [
    "CALL_ORDERS",
    "CALL_ORDER_ALIASES",
    "COMPRESSION_EXTRA_CONFIG_KEY",
    "DEFAULT_ARRIVALS",
    "DEFAULT_DECODE_STEPS",
    "DEFAULT_LOAD_STEPS",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_OUTPUT_TOKENS",
    "DEFAULT_STORE_STEPS",
    "DEFAULT_SWEEP_POINTS",
    "GIB",
    "PRESETS",
    "SIZE_RULE",
    "SPEC_EXTRA_CONFIG",
    "VLLM_ORDER_WORKLOADS",
    "WORKLOADS",
    "CallOrder",
    "GpuPrefixCache",
    "HookedManager",
    "KVDtype",
    "KvtritonOrder",
    "ManagerCalls",
    "ModelGeometry",
    "PointReport",
    "PositionedContext",
    "PrefixSharingParams",
    "PreparedRequest",
    "Recommendation",
    "ReplayStats",
    "Request",
    "RequestOutcome",
    "ServerModel",
    "ServerStats",
    "StoreOutput",
    "SweepPoint",
    "TokenRequest",
    "TokenWorkloadParams",
    "TraceSummary",
    "Track",
    "VllmOrder",
    "Workload",
    "block_hashes",
    "default_capacities",
    "format_bytes",
    "generate",
    "hooked_calls",
    "manager_calls",
    "parse_capacity",
    "parse_dtype",
    "parse_trace",
    "positioned_contexts",
    "predict",
    "prepare",
    "read_trace",
    "recommend",
    "replay",
    "replay_calls",
    "replay_vllm_order",
    "replay_vllm_server",
    "size_argument",
    "summarize",
    "sweep",
    "token_workload",
    "vllm_order",
    "vllm_order_calls",
    "write_trace",
]
