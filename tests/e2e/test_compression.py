"""``kvtriton_kv_compression: "fp8-e4m3"`` in a real engine: external hits as without it, half the bytes, drift measured.

The tiny Llama runs in bf16 here, the dtype the "about half the bytes" figure
is for (its fp32 KV cache would compress to about a quarter). The warm run's
prefix comes only from the compressed slab (the engine's KV cache is zeroed
first), so each loaded block must be within fp8's precision of the cold
run's block and not equal to it. Compression is lossy, so the warm run's
tokens may drift from the cold run's: the top-1 agreement and the drift of
the log-probabilities are reported (the run's "end-to-end figures"), not asserted. An uncompressed warm run
equals the cold run bit for bit (``test_single_tier.py``), so the cold run
stands for "uncompressed offload" here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from e2e.engine import RESET_PREFIX_CACHE, ZERO_KV_CACHE, EngineJob, EngineResult, StepResult, generate, run_engine, spec_config
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

HITS = "vllm:external_prefix_cache_hits"
LOADED = "vllm:kv_offload_load_bytes"
STORED = "vllm:kv_offload_store_bytes"
FULL_BLOCKS = len(PROMPT_A) // BLOCK_SIZE
TOP_LOGPROBS = 20
"""Log-probabilities recorded per generated position (vLLM's default ``max_logprobs``)."""
FP8_RELATIVE_ERROR = 0.05
"""A ceiling on a loaded block's relative error: e4m3 keeps 3 mantissa bits (about 2.5% RMS on this model's KV)."""


@pytest.fixture(scope="module")
def compressed(llama: Path, e2e_dir: Path) -> EngineResult:
    """Cold, reset, warm with the KV cache zeroed first: the warm run's prefix comes only from the compressed slab."""
    steps = [
        generate(PROMPT_A, MAX_TOKENS, "cold", logprobs=TOP_LOGPROBS),
        RESET_PREFIX_CACHE,
        ZERO_KV_CACHE,
        generate(PROMPT_A, MAX_TOKENS, "warm", compare_to="cold", logprobs=TOP_LOGPROBS),
    ]
    config = spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=8 << 20, kvtriton_kv_compression="fp8-e4m3")
    job = EngineJob(model=str(llama), steps=steps, kv_transfer_config=config, block_size=BLOCK_SIZE, dtype="bfloat16")
    return run_engine(job, e2e_dir / "compression")


def drift(cold: StepResult, warm: StepResult) -> tuple[int, list[float]]:
    """Positions while both runs saw the same context (up to the first differing token, inclusive) and, at each,
    ``|log p_warm(t) - log p_cold(t)|`` for the cold run's token ``t`` (``inf`` when ``t`` fell out of warm's top list).
    """
    positions = next((index + 1 for index, (a, b) in enumerate(zip(cold.token_ids, warm.token_ids)) if a != b), len(cold.token_ids))
    drifts = [
        abs(warm.logprobs[index].get(token, -math.inf) - cold.logprobs[index][token])
        for index, token in enumerate(cold.token_ids[:positions])
    ]
    return positions, drifts


def test_with_compression_every_full_block_is_an_external_hit_and_the_bytes_moved_halve(
    compressed: EngineResult, report_figure: Callable[[str], None]
) -> None:
    run = compressed
    assert "kv_compression=fp8-e4m3" in run.log
    raw_bytes = FULL_BLOCKS * run.kv_bytes_per_block  # what the uncompressed spec stores (tests/e2e/test_single_tier.py)
    stored = run.delta("cold", STORED)
    assert run.delta("cold", HITS) == 0
    assert run.delta("warm", HITS) == FULL_BLOCKS * BLOCK_SIZE, "every full block is an external hit"
    assert run.step("warm").num_cached_tokens == FULL_BLOCKS * BLOCK_SIZE
    assert run.delta("warm", LOADED) == stored, "the bytes loaded are the (compressed) bytes stored"
    assert run.delta("warm", STORED) == 0
    ratio = stored / raw_bytes
    assert 0.45 < ratio < 0.6, f"bf16 KV compressed to {ratio:.3f} of its bytes (expected about 0.52)"

    warm = run.step("warm")
    assert warm.blocks_relative_error is not None
    for block, error in enumerate(warm.blocks_relative_error):
        assert 0 < error < FP8_RELATIVE_ERROR, f"block {block}: relative error {error:.4f} after a compressed load"

    cold = run.step("cold")
    assert len(cold.logprobs) == len(warm.logprobs) == len(cold.token_ids)
    positions, drifts = drift(cold, warm)
    agreeing = sum(a == b for a, b in zip(cold.token_ids, warm.token_ids))
    report_figure(
        f"compression fp8-e4m3, bf16 KV: {stored:.0f} bytes stored for {FULL_BLOCKS} blocks instead of {raw_bytes} "
        f"({ratio:.3f}); loaded blocks' relative error {min(warm.blocks_relative_error):.4f}-"
        f"{max(warm.blocks_relative_error):.4f}; greedy top-1 agreement warm vs cold {agreeing}/{len(cold.token_ids)} "
        f"(first token {'agrees' if cold.token_ids[0] == warm.token_ids[0] else 'differs'}); "
        f"|d logprob| of the cold run's token over the {positions} position(s) of equal context: "
        + ", ".join(f"{value:.3f}" for value in drifts)
    )
