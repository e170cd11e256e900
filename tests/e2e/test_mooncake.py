"""KVTritonTieringOffloadingSpec with kvtriton's Mooncake Store tier, across engine processes: a prefix stored by one
engine serves another; another namespace, a damaged value or other weights at the same path is a miss, never wrong
tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from mooncake_fixtures import MOONCAKE_MISSING, MooncakeCluster

from bench.tiny_models import TinyLlama
from e2e.engine import (
    CHECK_MOONCAKE_VALUES_SEALED,
    DAMAGE_MOONCAKE_VALUES,
    HITS,
    EngineResult,
    generate,
    mooncake_job,
    run_engine,
)
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

if MOONCAKE_MISSING is not None:
    pytest.skip(MOONCAKE_MISSING, allow_module_level=True)

# The fixture by its own name (`x as x`: imported for pytest to find, not to call).
from mooncake_fixtures.managers import cluster as cluster

FULL_TOKENS = len(PROMPT_A) // BLOCK_SIZE * BLOCK_SIZE


def mooncake_engine(
    model: Path, cluster: MooncakeCluster, namespace: str, workdir: Path, *, then: Sequence[dict[str, object]] = ()
) -> EngineResult:
    steps = [generate(PROMPT_A, MAX_TOKENS, "A"), *then]
    return run_engine(mooncake_job(model, cluster.master_address, namespace, steps), workdir)


@pytest.fixture(scope="module")
def model(e2e_dir: Path) -> Path:
    """The e2e tests' tiny Llama (so the reference engine's tokens are its own) at a path of this module's own: the
    last test writes other weights over it."""
    return TinyLlama().write(e2e_dir / "mooncake-llama")


@pytest.fixture(scope="module")
def writer(model: Path, cluster: MooncakeCluster, e2e_dir: Path) -> EngineResult:
    return mooncake_engine(model, cluster, "shared", e2e_dir / "mooncake-writer", then=[CHECK_MOONCAKE_VALUES_SEALED])


def test_first_process_stores_every_full_block_in_mooncake(writer: EngineResult, reference: EngineResult) -> None:
    assert writer.step("A").token_ids == reference.step("A").token_ids
    # Without kvtriton_encryption every value holds its chunk in the clear (what test_encryption.py checks is gone).
    measured = writer.step("check_mooncake_values_sealed").measured
    assert measured["values"] == len(PROMPT_A) // BLOCK_SIZE == measured["with_plaintext"]
    assert writer.delta("A", HITS) == 0
    assert (
        writer.delta("A", "vllm:kv_offload_tiering_write_bytes")
        == len(PROMPT_A) // BLOCK_SIZE * writer.tier_chunk_bytes  # each chunk with kvtriton's seal
    )


def test_second_process_loads_the_prefix_from_mooncake(
    writer: EngineResult, model: Path, cluster: MooncakeCluster, e2e_dir: Path, reference: EngineResult
) -> None:
    reader = mooncake_engine(model, cluster, "shared", e2e_dir / "mooncake-reader")
    assert reader.delta("A", HITS) == FULL_TOKENS
    assert reader.delta("A", "vllm:kv_offload_tiering_read_bytes") == writer.delta(
        "A", "vllm:kv_offload_tiering_write_bytes"
    )
    assert reader.step("A").token_ids == reference.step("A").token_ids


@pytest.fixture(scope="module")
def other(writer: EngineResult, model: Path, cluster: MooncakeCluster, e2e_dir: Path) -> EngineResult:
    """An engine in another namespace that, once it has stored A's chunks there, damages their values."""
    del writer  # namespace "shared" holds A's chunks; this engine looks in another
    return mooncake_engine(model, cluster, "other", e2e_dir / "mooncake-other", then=[DAMAGE_MOONCAKE_VALUES])


def test_another_namespace_gives_no_hit(other: EngineResult, reference: EngineResult) -> None:
    assert other.delta("A", HITS) == 0
    assert other.step("A").token_ids == reference.step("A").token_ids


def test_a_value_of_the_right_size_with_other_bytes_is_a_counted_miss_never_wrong_tokens(
    other: EngineResult, model: Path, cluster: MooncakeCluster, e2e_dir: Path, reference: EngineResult
) -> None:
    del other  # namespace "other" now holds A's chunks, each value the right size with 64 bytes flipped
    reader = mooncake_engine(model, cluster, "other", e2e_dir / "mooncake-damaged-reader")
    assert reader.delta("A", HITS) == 0
    assert reader.delta("A", "vllm:kv_offload_integrity_failures") >= 1
    assert "kvtriton integrity: tier 1:MooncakeStoreTier" in reader.log and "(reason checksum:" in reader.log
    assert reader.step("A").token_ids == reference.step("A").token_ids


def test_other_weights_at_the_same_path_miss_the_old_models_chunks_in_the_same_namespace(
    writer: EngineResult, other: EngineResult, model: Path, cluster: MooncakeCluster, e2e_dir: Path
) -> None:
    """A fine-tune copied over the old weights, the same namespace: another identity, so another keyspace (last in
    this file: it overwrites the module's model)."""
    del other  # every engine of the old weights has run
    TinyLlama().write(model, seed=1)
    redeployed = mooncake_engine(model, cluster, "shared", e2e_dir / "mooncake-redeployed")
    assert redeployed.delta("A", HITS) == 0
    assert redeployed.delta("A", "vllm:kv_offload_integrity_failures") == 0  # nothing of the old model was read
    assert redeployed.step("A").token_ids != writer.step("A").token_ids  # its own tokens, not the old model's
