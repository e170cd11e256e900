"""Load and abort through kvtriton: a KV cache too small for the batch (preemptions, evictions), requests aborted
mid-flight, then a fresh round; every request that ran to its end gives the reference tokens.

vLLM preempts a running request when the batch outgrows its KV cache and aborts
requests a client gave up on; either may happen while kvtriton stores or loads
that request's blocks. Nothing of either may reach another request's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.engine import (
    HITS,
    LOADED,
    RESET_PREFIX_CACHE,
    EngineJob,
    EngineResult,
    generate_batch,
    generate_with_aborts,
    run_engine,
    spec_config,
)
from e2e.prompts import BLOCK_SIZE

PREFIXES = [list(range(100 + 200 * family, 100 + 200 * family + 2 * BLOCK_SIZE)) for family in range(3)]
"""Three shared prefixes of two blocks: the requests of a family reuse each other's blocks."""
PROMPTS = [
    PREFIXES[index % 3] + list(range(700 + 17 * index, 700 + 17 * index + 16 + 5 * index)) for index in range(12)
]
"""Twelve prompts of 80 to 135 tokens, a family's prefix and a tail of their own."""
MAX_TOKENS = 96
"""Long enough that the 4 requests vLLM runs at once (the engine process's max_num_seqs) outgrow the KV cache as they
decode (6 to 8 blocks each at the end)."""
ABORTED = [1, 4, 6, 9, 11]
SMALL_KV_CACHE = 24 * BLOCK_SIZE * 1024
"""24 blocks of the tiny Llama (1 KiB per token at float32): the running requests outgrow it, so vLLM preempts."""


@pytest.fixture(scope="module")
def load_and_abort(llama: Path, e2e_dir: Path) -> tuple[EngineResult, EngineResult]:
    reference = run_engine(
        EngineJob(model=str(llama), steps=[generate_batch(PROMPTS, MAX_TOKENS, "all")]), e2e_dir / "aborts-reference"
    )
    steps = [
        generate_with_aborts(PROMPTS, MAX_TOKENS, "aborted", abort=ABORTED, abort_after_steps=40),
        RESET_PREFIX_CACHE,
        generate_with_aborts(PROMPTS, MAX_TOKENS, "fresh", abort=[], abort_after_steps=0),
    ]
    config = spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=4 << 20)
    kvtriton = run_engine(
        EngineJob(model=str(llama), steps=steps, kv_transfer_config=config, kv_cache_bytes=SMALL_KV_CACHE),
        e2e_dir / "aborts-kvtriton",
    )
    return reference, kvtriton


def test_requests_that_ran_to_their_end_give_the_reference_tokens(
    load_and_abort: tuple[EngineResult, EngineResult],
) -> None:
    reference, kvtriton = load_and_abort
    expected = [completion.token_ids for completion in reference.step("all").completions]
    aborted_round = [completion.token_ids for completion in kvtriton.step("aborted").completions]
    for index, tokens in enumerate(aborted_round):
        if index not in ABORTED:
            assert tokens == expected[index], f"prompt {index}"
    assert [completion.token_ids for completion in kvtriton.step("fresh").completions] == expected


def test_the_engine_preempted_and_the_fresh_round_loaded_from_kvtriton(
    load_and_abort: tuple[EngineResult, EngineResult],
) -> None:
    _, kvtriton = load_and_abort
    assert kvtriton.delta("aborted", "vllm:num_preemptions") + kvtriton.delta("fresh", "vllm:num_preemptions") > 0
    assert kvtriton.delta("fresh", HITS) > 0
    assert kvtriton.delta("fresh", LOADED) > 0
