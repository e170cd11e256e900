"""Hit-rate parity with the installed vLLM's own CPU manager, both driven in vLLM's call order.

For each of the four workloads measured in docs/manager.md and three
capacities (5 %, 10 % and 20 % of the trace's distinct prompt blocks), the
same trace is replayed by ``kvtriton.sim._vllm_order.replay_vllm_order``
through vLLM's ``CPUOffloadingManager`` and through kvtriton's manager behind
its vLLM adapter, with the key positions vLLM's scheduler records. kvtriton
must hit at least as often, within 0.1 percentage point, policy by policy
(LRU against LRU, ARC against ARC). Blocks of 64 tokens keep the default-sized
traces at a few thousand blocks, so the whole module runs in seconds.
"""

from __future__ import annotations

from functools import cache
from typing import cast

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from vllm.v1.kv_offload.base import LookupResult as VLLMLookupResult
from vllm.v1.kv_offload.base import ReqContext as VLLMReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VLLMCPUOffloadingManager
from vllm_fixtures.builders import SHARED_POLICIES

from kvtriton.integrations.vllm._manager import VLLMOffloadingManager
from kvtriton.manager import CPUOffloadingManager
from kvtriton.sim._replay import HookedManager, PreparedRequest, hooked_calls, positioned_contexts, prepare
from kvtriton.sim._vllm_order import replay_vllm_order
from kvtriton.sim._workloads import VLLM_ORDER_WORKLOADS, generate

BLOCK_SIZE = 64
CAPACITY_FRACTIONS = (0.05, 0.10, 0.20)
TOLERANCE_PP = 0.1


@cache
def trace(workload: str) -> tuple[list[PreparedRequest], int]:
    requests = prepare(generate(workload, seed=0, block_size=BLOCK_SIZE))
    distinct = len({key for request in requests for key in request.prompt_keys})
    return requests, distinct


def hit_rate_pp(manager: VLLMCPUOffloadingManager | VLLMOffloadingManager, requests: list[PreparedRequest]) -> float:
    calls = hooked_calls(cast(HookedManager, manager), hit=VLLMLookupResult.HIT, pending=VLLMLookupResult.HIT_PENDING)
    contexts = positioned_contexts(requests, lambda req_id: VLLMReqContext(req_id=req_id), block_size=BLOCK_SIZE)
    stats = replay_vllm_order(calls, requests, contexts, block_size=BLOCK_SIZE)
    assert stats.prompt_blocks == sum(len(request.prompt_keys) for request in requests)
    return 100.0 * stats.block_hit_rate


@pytest.mark.parametrize("fraction", CAPACITY_FRACTIONS)
@pytest.mark.parametrize("workload", VLLM_ORDER_WORKLOADS)
@pytest.mark.parametrize("policy", SHARED_POLICIES)
def test_kvtriton_through_the_adapter_hits_at_least_as_often_as_vllm(
    policy: str, workload: str, fraction: float
) -> None:
    requests, distinct = trace(workload)
    capacity = max(1, int(distinct * fraction))
    vllm = hit_rate_pp(VLLMCPUOffloadingManager(capacity, cache_policy=policy), requests)
    cpu = CPUOffloadingManager(capacity, policy)
    ours = hit_rate_pp(VLLMOffloadingManager(cpu, cpu), requests)
    # The capacities are small against the working set: hits are neither 0 nor everything.
    assert 0.0 < vllm < 100.0
    assert ours >= vllm - TOLERANCE_PP, (
        f"{workload} at {capacity} slots, {policy}: kvtriton {ours:.2f} % < vLLM {vllm:.2f} %"
    )
