"""``store_threshold=2`` in a real engine: a repeat served from the GPU prefix cache still counts as a store offer."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.engine import HITS, RESET_PREFIX_CACHE, STORED, EngineJob, EngineResult, generate, run_engine, spec_config
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

FULL_BLOCKS = len(PROMPT_A) // BLOCK_SIZE


@pytest.fixture(scope="module")
def threshold_run(llama: Path, e2e_dir: Path) -> EngineResult:
    steps = [
        generate(PROMPT_A, MAX_TOKENS, "first"),
        generate(PROMPT_A, MAX_TOKENS, "repeat"),  # the prompt is still in the GPU prefix cache
        RESET_PREFIX_CACHE,
        generate(PROMPT_A, MAX_TOKENS, "after_reset"),
    ]
    config = spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=8 << 20, store_threshold=2)
    return run_engine(EngineJob(model=str(llama), steps=steps, kv_transfer_config=config), e2e_dir / "store-threshold")


def test_a_prompt_seen_once_is_not_offloaded(threshold_run: EngineResult) -> None:
    assert threshold_run.delta("first", STORED) == 0


def test_a_repeat_served_from_the_gpu_prefix_cache_offloads_the_prompt(threshold_run: EngineResult) -> None:
    assert threshold_run.delta("repeat", "vllm:prefix_cache_hits") == FULL_BLOCKS * BLOCK_SIZE, "nothing recomputed"
    assert threshold_run.delta("repeat", STORED) == FULL_BLOCKS * threshold_run.kv_bytes_per_block


def test_the_offloaded_prompt_serves_the_next_request(threshold_run: EngineResult, reference: EngineResult) -> None:
    assert threshold_run.delta("after_reset", HITS) == FULL_BLOCKS * BLOCK_SIZE
    assert threshold_run.step("after_reset").token_ids == reference.step("A").token_ids
