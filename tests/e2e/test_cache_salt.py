"""``cache_salt`` keeps tenants apart through kvtriton's host slab and vLLM's fs tier behind kvtriton's primary
(issue 41): a request with another salt misses what one tenant stored, one with the same salt hits it.

vLLM mixes a request's ``cache_salt`` into its first block's hash, so every
later hash, and every tier's key, differs between salts while the tokens do
not: each request here is prompt A, and each gives the reference tokens.
Mooncake's case is in test_mooncake_master_faults.py (the same requests also
stream through its faults).
"""

from __future__ import annotations

from pathlib import Path

from e2e.engine import HITS, RESET_PREFIX_CACHE, EngineJob, EngineResult, generate, run_engine, spec_config
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

FULL_TOKENS = len(PROMPT_A) // BLOCK_SIZE * BLOCK_SIZE


def request(name: str, salt: str) -> dict[str, object]:
    return generate(PROMPT_A, MAX_TOKENS, name, cache_salt=salt)


def test_the_host_slab_serves_a_salt_only_to_the_same_salt(llama: Path, e2e_dir: Path, reference: EngineResult) -> None:
    steps = [
        request("tenant-a", "tenant-a"),
        RESET_PREFIX_CACHE,  # vLLM's own prefix cache forgets A: what hits now comes from kvtriton's slab
        request("tenant-b", "tenant-b"),
        RESET_PREFIX_CACHE,
        request("tenant-a-again", "tenant-a"),
    ]
    config = spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=8 << 20)
    result = run_engine(EngineJob(model=str(llama), steps=steps, kv_transfer_config=config), e2e_dir / "salt-slab")
    assert result.delta("tenant-a", HITS) == 0
    assert result.delta("tenant-b", HITS) == 0  # tenant A's blocks are in the slab, under other keys
    assert result.delta("tenant-a-again", HITS) == FULL_TOKENS
    for name in ("tenant-a", "tenant-b", "tenant-a-again"):
        assert result.step(name).token_ids == reference.step("A").token_ids, name


def test_the_fs_tier_serves_a_salt_only_to_the_same_salt(llama: Path, e2e_dir: Path, reference: EngineResult) -> None:
    config = spec_config(
        "KVTritonTieringOffloadingSpec",
        cpu_bytes_to_use=8 << 20,
        secondary_tiers=[{"type": "fs", "root_dir": str(e2e_dir / "salt-fs-root")}],
    )
    writer = run_engine(
        EngineJob(model=str(llama), steps=[request("tenant-a", "tenant-a")], kv_transfer_config=config),
        e2e_dir / "salt-fs-writer",
    )
    assert writer.delta("tenant-a", "vllm:kv_offload_tiering_write_bytes") > 0
    # A new engine: its host memory is empty, so a hit can only come from the disk.
    reader = run_engine(
        EngineJob(
            model=str(llama),
            steps=[request("tenant-b", "tenant-b"), request("tenant-a", "tenant-a")],
            kv_transfer_config=config,
        ),
        e2e_dir / "salt-fs-reader",
    )
    assert reader.delta("tenant-b", HITS) == 0
    assert reader.delta("tenant-a", HITS) == FULL_TOKENS
    assert reader.delta("tenant-a", "vllm:kv_offload_tiering_read_bytes") > 0
    for result, names in ((writer, ("tenant-a",)), (reader, ("tenant-b", "tenant-a"))):
        for name in names:
            assert result.step(name).token_ids == reference.step("A").token_ids, name
