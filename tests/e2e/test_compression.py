"""``kvtriton_kv_compression: "fp8-e4m3"`` in a real engine: external hits as without it, far fewer bytes moved.

The tiny Llama's KV cache is fp32, so a compressed row takes about a quarter
of the raw bytes (a bf16 cache: about half). Compression is lossy, so the
warm run's tokens may drift from the cold run's: the agreement is printed,
not asserted; the hits and the bytes are.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.engine import RESET_PREFIX_CACHE, ZERO_KV_CACHE, EngineJob, EngineResult, generate, run_engine, spec_config
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

HITS = "vllm:external_prefix_cache_hits"
LOADED = "vllm:kv_offload_load_bytes"
STORED = "vllm:kv_offload_store_bytes"
FULL_BLOCKS = len(PROMPT_A) // BLOCK_SIZE


@pytest.fixture(scope="module")
def compressed(llama: Path, e2e_dir: Path) -> EngineResult:
    """Cold, reset, warm with the KV cache zeroed first: the warm run's prefix comes only from the compressed slab."""
    steps = [
        generate(PROMPT_A, MAX_TOKENS, "cold"),
        RESET_PREFIX_CACHE,
        ZERO_KV_CACHE,
        generate(PROMPT_A, MAX_TOKENS, "warm", compare_to="cold"),
    ]
    config = spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=8 << 20, kvtriton_kv_compression="fp8-e4m3")
    job = EngineJob(model=str(llama), steps=steps, kv_transfer_config=config, block_size=BLOCK_SIZE)
    return run_engine(job, e2e_dir / "compression")


def test_with_compression_every_full_block_is_an_external_hit_and_the_bytes_moved_shrink(
    compressed: EngineResult, reference: EngineResult
) -> None:
    run = compressed
    assert "kv_compression=fp8-e4m3" in run.log
    raw_bytes = FULL_BLOCKS * run.kv_bytes_per_block  # what the uncompressed spec stores (tests/e2e/test_single_tier.py)
    stored = run.delta("cold", STORED)
    assert run.delta("cold", HITS) == 0
    assert run.step("cold").token_ids == reference.step("A").token_ids  # nothing loaded yet: the model's own tokens
    assert run.delta("warm", HITS) == FULL_BLOCKS * BLOCK_SIZE, "every full block is an external hit"
    assert run.step("warm").num_cached_tokens == FULL_BLOCKS * BLOCK_SIZE
    assert run.delta("warm", LOADED) == stored, "the bytes loaded are the (compressed) bytes stored"
    assert run.delta("warm", STORED) == 0
    ratio = stored / raw_bytes
    assert 0.2 < ratio < 0.3, f"fp32 KV compressed to {ratio:.3f} of its bytes (expected about 0.26)"

    cold, warm = run.step("cold").token_ids, run.step("warm").token_ids
    agreeing = sum(a == b for a, b in zip(cold, warm))
    drift = next((index for index, (a, b) in enumerate(zip(cold, warm)) if a != b), None)
    print(
        f"\ncompression fp8-e4m3: {stored:.0f} bytes stored for {FULL_BLOCKS} blocks instead of {raw_bytes} "
        f"({ratio:.3f}); greedy top-1 agreement warm vs cold {agreeing}/{len(cold)}, "
        f"first differing token: {'none' if drift is None else drift}; KV blocks bit-equal after the load: "
        f"{run.step('warm').blocks_equal}"
    )
