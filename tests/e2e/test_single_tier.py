"""KVTritonOffloadingSpec in a real engine: a prompt's KV comes back from kvtriton's host slab and gives the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.engine import (
    HITS,
    LOADED,
    OVERWRITE_HOST_SLAB,
    RESET_PREFIX_CACHE,
    STORED,
    ZERO_KV_CACHE,
    EngineJob,
    EngineResult,
    generate,
    run_engine,
    spec_config,
)
from e2e.prompts import MAX_TOKENS, PROMPT_A


def single_tier_run(model: Path, block_size: int, workdir: Path) -> EngineResult:
    """A cold, reset, warm (KV cache zeroed first), reset, slab overwritten, warm again: one engine for every assertion."""
    steps = [
        generate(PROMPT_A, MAX_TOKENS, "cold"),
        RESET_PREFIX_CACHE,
        ZERO_KV_CACHE,
        generate(PROMPT_A, MAX_TOKENS, "warm", compare_to="cold"),
        RESET_PREFIX_CACHE,
        OVERWRITE_HOST_SLAB,
        generate(PROMPT_A, MAX_TOKENS, "overwritten", compare_to="cold"),
    ]
    config = spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=8 << 20)
    return run_engine(
        EngineJob(model=str(model), steps=steps, kv_transfer_config=config, block_size=block_size), workdir
    )


SingleTier = tuple[int, int, EngineResult]
"""A block size, prompt A's full blocks at that size, and the run."""


@pytest.fixture(scope="module", params=[32, 64], ids=lambda size: f"block{size}")
def single_tier(request: pytest.FixtureRequest, llama: Path, e2e_dir: Path) -> SingleTier:
    block_size: int = request.param
    run = single_tier_run(llama, block_size, e2e_dir / f"single-tier-{block_size}")
    return block_size, len(PROMPT_A) // block_size, run


def test_cold_run_gives_reference_tokens_and_stores_every_full_block(
    single_tier: SingleTier, reference: EngineResult
) -> None:
    _, full_blocks, run = single_tier
    cold = run.step("cold")
    assert cold.token_ids == reference.step("A").token_ids
    assert run.delta("cold", HITS) == 0
    assert run.delta("cold", STORED) == full_blocks * run.kv_bytes_per_block > 0


def test_warm_run_loads_every_full_block_and_gives_reference_tokens(
    single_tier: SingleTier, reference: EngineResult
) -> None:
    block_size, full_blocks, run = single_tier
    warm = run.step("warm")
    assert run.delta("warm", HITS) == full_blocks * block_size, "every full block is an external hit"
    assert warm.num_cached_tokens == full_blocks * block_size
    assert run.delta("warm", LOADED) == run.delta("cold", STORED), "the bytes loaded are the bytes stored"
    assert run.delta("warm", STORED) == 0, "nothing new to store"
    assert warm.blocks_equal == [True] * full_blocks, "each loaded block holds the bytes computed for it"
    assert warm.token_ids == reference.step("A").token_ids


def test_tokens_come_from_the_offloaded_bytes(single_tier: SingleTier, reference: EngineResult) -> None:
    """Negative control: with the host slab overwritten, the loaded prefix is garbage and the tokens change."""
    block_size, full_blocks, run = single_tier
    overwritten = run.step("overwritten")
    assert run.delta("overwritten", HITS) == full_blocks * block_size
    assert overwritten.blocks_equal == [False] * full_blocks
    assert overwritten.token_ids != reference.step("A").token_ids


def test_the_host_load_debug_check_passes_every_load_a_real_engine_makes(
    llama: Path, e2e_dir: Path, reference: EngineResult
) -> None:
    """``kvtriton_verify_host_loads``: the worker's digests follow vLLM's real store and load jobs (no false refusal).

    The refusal itself (a changed slot stops the engine) is the worker's unit tests' to show: vLLM then exits.
    """
    steps = [
        generate(PROMPT_A, MAX_TOKENS, "cold"),
        RESET_PREFIX_CACHE,
        ZERO_KV_CACHE,
        generate(PROMPT_A, MAX_TOKENS, "warm", compare_to="cold"),
    ]
    config = spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=8 << 20, kvtriton_verify_host_loads=True)
    job = EngineJob(model=str(llama), steps=steps, kv_transfer_config=config)
    run = run_engine(job, e2e_dir / "verified-loads")
    assert run.delta("warm", LOADED) == run.delta("cold", STORED) > 0
    assert run.step("warm").token_ids == reference.step("A").token_ids
    assert run.step("warm").blocks_equal == [True] * (len(PROMPT_A) // job.block_size)
    assert "refused by kvtriton_verify_host_loads" not in run.log
