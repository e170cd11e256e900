"""KVTritonTieringOffloadingSpec with vLLM's ``fs`` tier: one engine's prefix, written to disk, serves the next engine."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from e2e.engine import EngineJob, EngineResult, generate, run_engine, spec_config
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

HITS = "vllm:external_prefix_cache_hits"
FULL_TOKENS = len(PROMPT_A) // BLOCK_SIZE * BLOCK_SIZE


def fs_engine(model: Path, root: Path, workdir: Path) -> EngineResult:
    """A fresh engine (empty host memory) on the fs root ``root``, generating A once."""
    config = spec_config(
        "KVTritonTieringOffloadingSpec",
        cpu_bytes_to_use=8 << 20,
        secondary_tiers=[{"type": "fs", "root_dir": str(root)}],
    )
    return run_engine(
        EngineJob(model=str(model), steps=[generate(PROMPT_A, MAX_TOKENS, "A")], kv_transfer_config=config), workdir
    )


@pytest.fixture(scope="module")
def fs_root(e2e_dir: Path) -> Path:
    return e2e_dir / "fs-root"


@pytest.fixture(scope="module")
def writer(llama: Path, fs_root: Path, e2e_dir: Path) -> EngineResult:
    return fs_engine(llama, fs_root, e2e_dir / "fs-writer")


def test_first_process_writes_every_full_block_to_disk(
    writer: EngineResult, fs_root: Path, reference: EngineResult
) -> None:
    assert writer.step("A").token_ids == reference.step("A").token_ids
    assert writer.delta("A", HITS) == 0
    written = writer.delta("A", "vllm:kv_offload_tiering_write_bytes")
    assert written == len(PROMPT_A) // BLOCK_SIZE * writer.tier_chunk_bytes  # each chunk with its seal
    assert sum(path.stat().st_size for path in fs_root.rglob("*.bin")) >= written


def test_second_process_serves_the_prefix_from_disk(
    writer: EngineResult, llama: Path, fs_root: Path, e2e_dir: Path, reference: EngineResult
) -> None:
    reader = fs_engine(llama, fs_root, e2e_dir / "fs-reader")
    assert reader.delta("A", HITS) == FULL_TOKENS
    assert reader.delta("A", "vllm:kv_offload_tiering_read_bytes") == writer.delta(
        "A", "vllm:kv_offload_tiering_write_bytes"
    )
    assert reader.delta("A", "vllm:kv_offload_load_bytes") == writer.delta("A", "vllm:kv_offload_store_bytes")
    assert reader.step("A").token_ids == reference.step("A").token_ids


def test_another_fs_root_gives_no_hit(
    writer: EngineResult, llama: Path, e2e_dir: Path, reference: EngineResult
) -> None:
    del writer  # the shared root holds A's blocks; this engine looks in another
    other = fs_engine(llama, e2e_dir / "fs-other-root", e2e_dir / "fs-other")
    assert other.delta("A", HITS) == 0
    assert other.step("A").token_ids == reference.step("A").token_ids


def test_the_kv_files_on_disk_are_the_server_users_alone(writer: EngineResult, fs_root: Path) -> None:
    # vLLM's fs tier writes its files with the umask (0644 files, 0755 directories under 022): they stay private
    # because kvtriton made the root they sit under 0700, before the tier wrote anything.
    assert stat.S_IMODE(fs_root.stat().st_mode) == 0o700
    beneath = [fs_root, *fs_root.rglob("*")]
    assert any(path.suffix == ".bin" for path in beneath)
    assert all(path.stat().st_uid == os.geteuid() for path in beneath)
    assert "root_dir" in writer.log and "private to user" in writer.log
    lines = [line for line in writer.log.splitlines() if "kvtriton tiered offloading (rank 0 of 1)" in line]
    assert lines and all("files private to user" in line for line in lines)
    assert "tier roots made 0700, the host region 0600" in lines[0]


def test_a_real_engine_logs_one_complete_identity(writer: EngineResult) -> None:
    # The engine core (which seals and files the chunks) logs it; its worker computes the same one and logs none.
    # Before, the worker logged model_dtype=float32 and the engine core, whose identity was in use, model_dtype=.
    lines = [line for line in writer.log.splitlines() if "kvtriton tiered offloading identity" in line]
    assert len(lines) == 1, lines
    assert "model_dtype=float32 " in lines[0] and "(computed)" in lines[0]
