"""Models whose KV caches are laid out differently: a hybrid model (sliding-window and full attention groups) and MLA."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_models import TinyDeepseekV2, TinyLlama
from e2e.engine import RESET_PREFIX_CACHE, ZERO_KV_CACHE, EngineJob, EngineResult, generate, run_engine, spec_config
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

HITS = "vllm:external_prefix_cache_hits"
SLIDING_WINDOW = 2 * BLOCK_SIZE


@pytest.fixture(scope="module")
def hybrid_llama(e2e_dir: Path) -> Path:
    """A sliding-window layer beside a full-attention layer: vLLM builds two KV cache groups."""
    model = TinyLlama(layer_types=("sliding_attention", "full_attention"), sliding_window=SLIDING_WINDOW)
    return model.write(e2e_dir / "hybrid-llama")


@pytest.fixture(scope="module")
def hybrid_runs(hybrid_llama: Path, e2e_dir: Path) -> tuple[EngineResult, EngineResult]:
    reference = run_engine(
        EngineJob(model=str(hybrid_llama), steps=[generate(PROMPT_A, MAX_TOKENS, "A")]), e2e_dir / "hybrid-reference"
    )
    steps = [generate(PROMPT_A, MAX_TOKENS, "cold"), RESET_PREFIX_CACHE, generate(PROMPT_A, MAX_TOKENS, "warm")]
    config = spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=8 << 20)
    offloaded = run_engine(
        EngineJob(model=str(hybrid_llama), steps=steps, kv_transfer_config=config), e2e_dir / "hybrid"
    )
    return reference, offloaded


def test_hybrid_model_has_two_kv_cache_groups(hybrid_runs: tuple[EngineResult, EngineResult]) -> None:
    _, offloaded = hybrid_runs
    assert "kvtriton worker: 2 KV cache group(s)" in offloaded.log


def test_hybrid_prefix_comes_back_from_kvtriton_with_reference_tokens(
    hybrid_runs: tuple[EngineResult, EngineResult],
) -> None:
    reference, offloaded = hybrid_runs
    full_blocks = len(PROMPT_A) // BLOCK_SIZE
    assert offloaded.step("cold").token_ids == reference.step("A").token_ids
    stored = offloaded.delta("cold", "vllm:kv_offload_store_bytes")
    # The full-attention group stores every full block; the sliding-window group at least the window's.
    group_block_bytes = offloaded.kv_bytes_per_block
    assert full_blocks * group_block_bytes + SLIDING_WINDOW // BLOCK_SIZE * group_block_bytes <= stored
    assert stored <= 2 * full_blocks * group_block_bytes
    assert offloaded.delta("warm", HITS) == full_blocks * BLOCK_SIZE
    assert offloaded.delta("warm", "vllm:kv_offload_load_bytes") == stored
    assert offloaded.step("warm").token_ids == reference.step("A").token_ids


MLA_BLOCK_SIZE = 16
"""The only block size vLLM's CPU MLA kernel takes."""
MLA_PROMPT = list(range(10, 10 + 4 * MLA_BLOCK_SIZE + 5))


def test_mla_blocks_come_back_bit_exact(e2e_dir: Path) -> None:
    """An MLA model (one latent KV tensor per layer, no K/V split): every full block is loaded back byte for byte.

    The tokens are not held to a reference here: vLLM 0.33's CPU platform
    turns prefix caching and chunked prefill off for MLA models (its
    'MLA is enabled on a non-GPU platform' message), and its CPU MLA prefill
    attending to a context that a connector loaded gives other tokens than a
    full prefill, even with every loaded byte right (checked below).
    """
    model = TinyDeepseekV2().write(e2e_dir / "mla")
    steps = [
        generate(MLA_PROMPT, MAX_TOKENS, "cold"),
        RESET_PREFIX_CACHE,
        ZERO_KV_CACHE,
        generate(MLA_PROMPT, MAX_TOKENS, "warm", compare_to="cold"),
    ]
    config = spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=8 << 20)
    # The reference CPU MLA backend on every CPU (an AMX CPU would otherwise pick AMX_MLA).
    job = EngineJob(
        model=str(model), steps=steps, kv_transfer_config=config, block_size=MLA_BLOCK_SIZE, attention_backend="CPU_MLA"
    )
    run = run_engine(job, e2e_dir / "mla-run")
    full_blocks = len(MLA_PROMPT) // MLA_BLOCK_SIZE
    assert "Using CPU_MLA backend" in run.log
    assert run.delta("cold", "vllm:kv_offload_store_bytes") == full_blocks * run.kv_bytes_per_block > 0
    assert run.delta("warm", HITS) == full_blocks * MLA_BLOCK_SIZE
    assert run.delta("warm", "vllm:kv_offload_load_bytes") == run.delta("cold", "vllm:kv_offload_store_bytes")
    assert run.step("warm").blocks_equal == [True] * full_blocks
