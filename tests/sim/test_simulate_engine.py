"""The engine model of ``kvtriton simulate --call-order vllm``: GPU prefix cache, admission, transfer timing, rule by rule.

Its agreement with vLLM's own scheduler on whole workloads is checked in
``tests/sim/test_simulate_vllm_scheduler.py``; these tests pin each rule on a
trace small enough to follow by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import LookupResult, ReqContext
from kvtriton.manager import CPUOffloadingManager
from kvtriton.sim._gpu_prefix_cache import GpuPrefixCache
from kvtriton.sim._replay import PreparedRequest, StoreOutput, hooked_calls, positioned_contexts, prepare
from kvtriton.sim._vllm_server import ServerModel, ServerStats, replay_vllm_server
from kvtriton.sim._workloads import Request

BLOCK = 16


def trace(*prompts: str, tail: int = 1) -> list[PreparedRequest]:
    """One request per string, a block per letter, plus ``tail`` tokens of a partial last block."""
    return prepare(
        [
            Request(f"r{i}", tuple(c.encode() for c in blocks), BLOCK * len(blocks) + tail)
            for i, blocks in enumerate(prompts)
        ]
    )


class Recorder:
    """A kvtriton manager whose lookups and stores are logged per request."""

    def __init__(self, capacity: int) -> None:
        self.manager = CPUOffloadingManager(capacity)
        self.lookups: list[tuple[str, str]] = []
        self.stores: list[tuple[str, int]] = []

    def lookup(self, key: OffloadKey, req_context: ReqContext, /) -> object:
        result = self.manager.lookup(key, req_context)
        self.lookups.append((req_context.req_id, result.name))
        return result

    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext, /) -> object:
        return self.manager.prepare_load(keys, req_context)

    def prepare_store(self, keys: Sequence[OffloadKey], req_context: ReqContext, /) -> StoreOutput | None:
        self.stores.append((req_context.req_id, len(keys)))
        return self.manager.prepare_store(keys, req_context)

    def complete_load(self, keys: Sequence[OffloadKey], req_context: ReqContext, /) -> None:
        self.manager.complete_load(keys, req_context)

    def complete_store(self, keys: Sequence[OffloadKey], req_context: ReqContext, /) -> None:
        self.manager.complete_store(keys, req_context)

    def on_new_request(self, req_context: ReqContext, /) -> None:
        self.manager.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext, /) -> None:
        self.manager.on_request_finished(req_context)


def run(requests: list[PreparedRequest], model: ServerModel, recorder: Recorder | None = None) -> ServerStats:
    manager = recorder if recorder is not None else Recorder(64)
    contexts = positioned_contexts(requests, lambda req_id: ReqContext(req_id=req_id), block_size=BLOCK)
    calls = hooked_calls(manager, hit=LookupResult.HIT, pending=LookupResult.HIT_PENDING)
    stats = replay_vllm_server(calls, requests, contexts, block_size=BLOCK, model=model)
    after = manager.manager.stats()
    assert (after.pending, after.loading) == (0, 0)  # every transfer completed
    return stats


def outcome(stats: ServerStats, req_id: str) -> tuple[int, int, int]:
    (found,) = [o for o in stats.outcomes if o.req_id == req_id]
    return found.gpu_hit_tokens, found.external_query_tokens, found.external_hit_tokens


# --------------------------------------------------------------------------
# The GPU prefix cache


def test_a_prefix_the_gpu_cache_holds_is_never_asked_of_the_offload_tier() -> None:
    recorder = Recorder(64)
    stats = run(trace("abc", "abc"), ServerModel(sequential=True, gpu_blocks=32), recorder)
    # r1's three full blocks come from the GPU cache; its partial last block is computed.
    assert outcome(stats, "r1") == (48, 1, 0)
    assert [entry for entry in recorder.lookups if entry[0] == "r1"] == []
    # vLLM's rate counts only what the GPU cache did not serve: r0's 49 tokens and r1's last one, no hits.
    assert (stats.external_query_tokens, stats.external_hit_tokens, stats.external_hit_rate) == (50, 0, 0.0)
    assert stats.gpu_share == 48 / 98


def test_what_the_gpu_cache_evicted_is_loaded_from_the_offload_tier() -> None:
    # 5 blocks: one for vLLM's null block, four for KV; r1 takes the blocks r0 left cached.
    stats = run(trace("abc", "xyz", "abc"), ServerModel(sequential=True, gpu_blocks=5))
    assert outcome(stats, "r2") == (0, 49, 48)
    assert stats.gpu_evictions > 0
    assert stats.offload_share == 48 / (3 * 49)
    assert stats.computed_share == pytest.approx(1 - 48 / (3 * 49))


def test_a_whole_prompt_hit_counts_every_token_and_recomputes_the_last() -> None:
    # Block-aligned prompts: the GPU cache may serve at most prompt - 1 tokens, so its last block is
    # looked up in the offload tier, where it hits: vLLM counts 16 queries and 16 hits.
    recorder = Recorder(64)
    stats = run(trace("ab", "ab", tail=0), ServerModel(sequential=True, gpu_blocks=32), recorder)
    assert outcome(stats, "r1") == (16, 16, 16)
    # r1 arrives while r0's store is in flight: it waits (HIT_PENDING) until the block is stored, then loads it.
    lookups = [result for req_id, result in recorder.lookups if req_id == "r1"]
    assert set(lookups[:-1]) <= {"HIT_PENDING"} and lookups[-1] == "HIT"


def test_without_gpu_blocks_every_prompt_block_is_looked_up() -> None:
    stats = run(trace("abc", "abc"), ServerModel(sequential=True))
    assert outcome(stats, "r1") == (0, 49, 48)
    assert stats.gpu_share == 0.0


# --------------------------------------------------------------------------
# Admission


def test_requests_waiting_for_their_load_do_not_count_against_max_num_seqs() -> None:
    # r0 computes and stores the shared prefix alone (max_num_seqs 1); the five others find it
    # pending, then all hit and load in one step: loading requests are not running.
    stats = run(trace("abcd", "abcdv", "abcdw", "abcdx", "abcdy", "abcdz"), ServerModel(max_num_seqs=1))
    assert stats.max_admitted_per_step == 5
    assert [outcome(stats, f"r{i}")[2] for i in range(1, 6)] == [64] * 5
    assert stats.replay.pending_stops > 0  # they waited for r0's store


def test_max_num_seqs_bounds_the_requests_that_compute_at_once() -> None:
    stats = run(trace("a", "b", "c", "d", "e"), ServerModel(max_num_seqs=2))
    assert stats.max_admitted_per_step == 2
    assert run(trace("a", "b", "c", "d", "e"), ServerModel()).max_admitted_per_step == 5


def test_sequential_requests_arrive_once_the_previous_one_finished_and_wait_for_its_stores() -> None:
    # A client waiting for each answer sends the next request while the previous one's store is in flight:
    # the lookup meets it pending and the request waits, then hits everything stored.
    stats = run(trace("ab", "abc", "abcd"), ServerModel(sequential=True, store_steps=3))
    assert stats.max_admitted_per_step == 1
    # r0 computes at step 1, its store done at the end of step 4: r1 arrives at step 2 and waits 3 steps, loads
    # at step 5, computes at step 6 (store done at the end of step 9): r2 arrives at step 7 and waits 3 steps.
    assert [outcome.admitted_step for outcome in stats.outcomes] == [1, 5, 10]
    assert [outcome.deferrals for outcome in stats.outcomes] == [0, 3, 3]
    assert [outcome(stats, f"r{i}")[2] for i in range(3)] == [0, 32, 48]


def test_a_later_store_completion_defers_the_requests_that_hit_it_longer() -> None:
    prompts = ("ab",) + ("abc",) * 4
    quick = run(trace(*prompts), ServerModel(arrivals=1, store_steps=1))
    slow = run(trace(*prompts), ServerModel(arrivals=1, store_steps=4))
    assert slow.replay.pending_stops > quick.replay.pending_stops
    assert slow.steps > quick.steps


def test_the_token_budget_splits_a_long_prompt_into_chunks() -> None:
    one_step = run(trace("abcdefgh"), ServerModel(max_num_batched_tokens=2048))
    chunked = run(trace("abcdefgh"), ServerModel(max_num_batched_tokens=32))
    assert chunked.steps > one_step.steps
    assert chunked.replay.blocks_stored == one_step.replay.blocks_stored == 8


def test_a_request_that_runs_out_of_gpu_blocks_preempts_the_last_one_running() -> None:
    # Four KV blocks; two requests of 17 prompt tokens each hold two, then decode into a third.
    recorder = Recorder(64)
    stats = run(trace("a", "b"), ServerModel(gpu_blocks=5, output_tokens=32), recorder)
    assert stats.preemptions >= 1
    # r1, the last one running, started over: its prompt block was still in the GPU cache (freed to
    # the back of the queue), so it asked the offload tier nothing the second time. Only its first
    # admission counts, as in vLLM's metrics.
    assert [entry for entry in recorder.lookups if entry[0] == "r1"] == [("r1", "MISS")]
    assert outcome(stats, "r1") == (0, 17, 0)
    assert stats.external_query_tokens == 34


# --------------------------------------------------------------------------
# Refusals


def test_a_request_larger_than_the_gpu_cache_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"request 'r0' needs 4 GPU blocks .* gpu_blocks=4 leaves 3"):
        run(trace("abc"), ServerModel(gpu_blocks=4))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"gpu_blocks": 1}, "gpu_blocks must be >= 2, got 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"store_steps": 0}, "store_steps must be >= 1, got 0"),
        ({"sequential": True, "arrivals": 2}, "sequential and arrivals=2 are two arrival patterns"),
    ],
)
def test_bad_engine_settings_are_refused_by_name(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerModel(**settings)  # pyright: ignore[reportArgumentType] -- each case sets fields of mixed types


# --------------------------------------------------------------------------
# The block pool


def test_block_zero_is_the_null_block() -> None:
    assert GpuPrefixCache(3).num_free == 2
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        GpuPrefixCache(1)


def test_a_freed_request_is_evicted_tail_first_after_the_never_used_blocks() -> None:
    pool = GpuPrefixCache(5)  # blocks 1..4
    first = pool.allocate(2)
    assert first == [1, 2]
    pool.cache(1, "a")
    pool.cache(2, "b")
    pool.free(first)
    # The free queue: 3, 4 (never used), then 2 (the tail) before 1.
    assert pool.allocate(3) == [3, 4, 2]
    assert pool.evictions == 1
    assert pool.cached_prefix(["a", "b"], 2) == [1]


def test_freed_blocks_without_a_hash_are_reused_first() -> None:
    pool = GpuPrefixCache(5)
    blocks = pool.allocate(4)
    pool.cache(1, "a")
    pool.free(blocks)  # 4, 3, 2 hold no hash: they go to the head, the tail first
    assert pool.allocate(2) == [4, 3]
    assert pool.evictions == 0
    assert pool.cached_prefix(["a"], 1) == [1]


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = GpuPrefixCache(4)
    (block,) = pool.allocate(1)
    pool.cache(block, "a")
    pool.free([block])
    hit = pool.cached_prefix(["a", "b"], 2)
    assert hit == [block] and pool.evictable(hit) == 1
    pool.touch(hit)
    assert pool.num_free == 2
    assert pool.allocate(2) == [2, 3]  # the touched block is not among them
    assert pool.cached_prefix(["a"], 1) == [block]


def test_the_cache_answers_at_most_max_blocks() -> None:
    pool = GpuPrefixCache(8)
    blocks = pool.allocate(3)
    for block, key in zip(blocks, "abc"):
        pool.cache(block, key)
    assert pool.cached_prefix(list("abc"), 2) == blocks[:2]
    assert pool.cached_prefix(list("abx"), 5) == blocks[:2]
