"""The vLLM-order replay makes the connector's calls, step by step, in its order."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import LookupResult, ReqContext
from kvtriton.manager import CPUOffloadingManager
from kvtriton.sim._replay import PreparedRequest, StoreOutput, hooked_calls, positioned_contexts, prepare
from kvtriton.sim._vllm_order import replay_vllm_order, vllm_order
from kvtriton.sim._workloads import Request, generate


class Recorder:
    """A manager that logs every call; answers come from a real kvtriton manager."""

    def __init__(self, capacity: int) -> None:
        self.manager = CPUOffloadingManager(capacity)
        self.log: list[tuple[str, str, int]] = []

    def _note(self, call: str, context: ReqContext, count: int = 0) -> None:
        self.log.append((call, context.req_id, count))

    def lookup(self, key: OffloadKey, req_context: ReqContext, /) -> object:
        result = self.manager.lookup(key, req_context)
        self._note(f"lookup:{result.name}", req_context)
        return result

    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext, /) -> object:
        self._note("prepare_load", req_context, len(keys))
        return self.manager.prepare_load(keys, req_context)

    def prepare_store(self, keys: Sequence[OffloadKey], req_context: ReqContext, /) -> StoreOutput | None:
        self._note("prepare_store", req_context, len(keys))
        return self.manager.prepare_store(keys, req_context)

    def complete_load(self, keys: Sequence[OffloadKey], req_context: ReqContext, /) -> None:
        self._note("complete_load", req_context, len(keys))
        self.manager.complete_load(keys, req_context)

    def complete_store(self, keys: Sequence[OffloadKey], req_context: ReqContext, /) -> None:
        self._note("complete_store", req_context, len(keys))
        self.manager.complete_store(keys, req_context)

    def on_new_request(self, req_context: ReqContext, /) -> None:
        self._note("on_new_request", req_context)
        self.manager.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext, /) -> None:
        self._note("on_request_finished", req_context)
        self.manager.on_request_finished(req_context)


def requests_of(*prompts: Sequence[str]) -> list[PreparedRequest]:
    return prepare(
        [Request(f"r{i}", tuple(b.encode() for b in blocks), 16 * len(blocks)) for i, blocks in enumerate(prompts)]
    )


def run(recorder: Recorder, requests: list[PreparedRequest], *, sync_loads: bool = False) -> list[tuple[str, str, int]]:
    contexts = positioned_contexts(requests, lambda req_id: ReqContext(req_id=req_id), block_size=16)
    calls = hooked_calls(recorder, hit=LookupResult.HIT, pending=LookupResult.HIT_PENDING)
    replay_vllm_order(calls, requests, contexts, block_size=16, arrivals=1, decode_steps=1, sync_loads=sync_loads)
    return [entry for entry in recorder.log if not entry[0].startswith("lookup")]


def test_a_hit_loads_then_stores_the_rest_a_step_later_and_completions_lag() -> None:
    recorder = Recorder(8)
    log = run(recorder, requests_of(["a", "b"], ["a", "b", "c"]))
    assert log == [
        # step 1: r0 misses, computes and stores its prompt; it ends at step 2.
        ("on_new_request", "r0", 0),
        ("prepare_store", "r0", 2),
        # step 2: r1 finds its blocks still pending (r0's store completes at step 3): deferred.
        ("on_new_request", "r1", 0),
        ("on_request_finished", "r0", 0),
        # step 3: r0's store completes; r1 loads its two hits.
        ("complete_store", "r0", 2),
        ("prepare_load", "r1", 2),
        # step 4: the load completes, r1 computes and stores its third block.
        ("complete_load", "r1", 2),
        ("prepare_store", "r1", 1),
        # step 5: r1 ends; step 6: its store completes.
        ("on_request_finished", "r1", 0),
        ("complete_store", "r1", 1),
    ]
    assert ("lookup:HIT_PENDING", "r1", 0) in recorder.log


def test_sync_loads_store_in_the_step_of_the_load() -> None:
    recorder = Recorder(8)
    log = run(recorder, requests_of(["a"], ["x"], ["x"], ["a", "b"]), sync_loads=True)
    load = log.index(("prepare_load", "r3", 1))
    assert log[load + 1] == ("prepare_store", "r3", 1)


def test_touch_is_never_called_and_counts_add_up() -> None:
    requests = prepare(generate("prefix-tree", seed=1, block_size=64, overrides={"requests": 120}))
    manager = CPUOffloadingManager(200)
    stats = vllm_order(requests, manager, block_size=64)
    assert stats.requests == 120
    assert stats.prompt_blocks == sum(len(request.prompt_keys) for request in requests)
    assert 0 < stats.hit_blocks < stats.prompt_blocks
    assert stats.blocks_stored + stats.hit_blocks + stats.refused_blocks <= stats.prompt_blocks
    after = manager.stats()
    assert (after.pending, after.loading) == (0, 0)  # every job completed


def test_bad_step_shape_is_rejected_by_name() -> None:
    requests = requests_of(["a"])
    with pytest.raises(ValueError, match="arrivals must be >= 1, got 0"):
        vllm_order(requests, CPUOffloadingManager(4), block_size=16, arrivals=0)
    with pytest.raises(ValueError, match="decode_steps must be >= 1, got 0"):
        vllm_order(requests, CPUOffloadingManager(4), block_size=16, decode_steps=0)


def test_positions_are_each_keys_end_token() -> None:
    requests = requests_of(["a", "b", "c"])
    (context,) = positioned_contexts(requests, lambda req_id: ReqContext(req_id=req_id), block_size=16)
    assert [context.get_offload_key_position(key) for key in requests[0].prompt_keys] == [16, 32, 48]
