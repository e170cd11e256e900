"""``kvtriton_encryption`` with real engines across processes and kvtriton's Mooncake tier: sealed per tenant.

A writer stores a prefix under tenants A and B (each request's ``cache_salt``):
no pool value holds any 64-byte run of the chunk it was made from
(test_mooncake.py's unencrypted writer, same prompt, finds every value does).
A reader with the same master key and A's salt hits and gives the reference
tokens; with C's salt it misses. A reader started with another master key,
and one whose key rotated (the writer's id retired), miss with counted
decrypt failures and give the reference tokens. A flipped byte or a value
moved under another key are the tier's counted misses too
(tests/integrations/remote/test_tier_remote_encryption.py, over the same
tier base); a key file others may read stops the start with one line
(tests/integrations/vllm/test_encryption_setting.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path

import pytest
from mooncake_fixtures import MOONCAKE_MISSING, MooncakeCluster

from bench.tiny_models import TinyLlama
from e2e.engine import (
    CHECK_MOONCAKE_VALUES_SEALED,
    WAIT_TIERS_UP,
    EngineJob,
    EngineResult,
    generate,
    run_engine,
    spec_config,
)
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

if MOONCAKE_MISSING is not None:
    pytest.skip(MOONCAKE_MISSING, allow_module_level=True)
pytest.importorskip("cryptography", reason="encryption needs kvtriton's [encryption] extra")

# The fixture by its own name (`x as x`: imported for pytest to find, not to call).
from mooncake_fixtures.managers import cluster as cluster

from kvtriton.encryption import MasterKey

HITS = "vllm:external_prefix_cache_hits"
DECRYPT_FAILURES = "vllm:kv_offload_integrity_failures"
FULL_TOKENS = len(PROMPT_A) // BLOCK_SIZE * BLOCK_SIZE
PROMPT_B = PROMPT_A[::-1]  # another prefix, in the tiny model's vocabulary


def key_file(folder: Path, name: str) -> Path:
    """A fresh master key in a file of the server's user alone, as docs/security.md says to make one."""
    path = folder / name
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def sealed_engine(
    model: Path,
    cluster: MooncakeCluster,
    key: Path,
    workdir: Path,
    steps: Sequence[dict[str, object]],
    retired: Sequence[str] = (),
) -> EngineResult:
    tier = {
        "type": "MooncakeStoreTier",
        "module_path": "kvtriton.integrations.mooncake",
        "master_server_address": cluster.master_address,
        "namespace": "sealed",
        "timeout_s": 5.0,
        "io_threads": 2,
    }
    encryption: dict[str, object] = {"master_key_file": str(key), "retired_key_ids": list(retired)}
    config = spec_config(
        "KVTritonTieringOffloadingSpec",
        cpu_bytes_to_use=8 << 20,
        secondary_tiers=[tier],
        kvtriton_encryption=encryption,
    )
    return run_engine(EngineJob(model=str(model), steps=[WAIT_TIERS_UP, *steps], kv_transfer_config=config), workdir)


@pytest.fixture(scope="module")
def keys(e2e_dir: Path) -> dict[str, Path]:
    folder = e2e_dir / "encryption-keys"
    folder.mkdir(exist_ok=True)
    return {name: key_file(folder, f"{name}.key") for name in ("writer", "other", "rotated")}


@pytest.fixture(scope="module")
def model(e2e_dir: Path) -> Path:
    return TinyLlama().write(e2e_dir / "encryption-llama")


@pytest.fixture(scope="module")
def writer(model: Path, cluster: MooncakeCluster, keys: dict[str, Path], e2e_dir: Path) -> EngineResult:
    steps = [
        generate(PROMPT_A, MAX_TOKENS, "A", cache_salt="tenant-a"),
        generate(PROMPT_B, MAX_TOKENS, "B", cache_salt="tenant-b"),
        CHECK_MOONCAKE_VALUES_SEALED,
    ]
    return sealed_engine(model, cluster, keys["writer"], e2e_dir / "encryption-writer", steps)


def test_the_writer_stores_both_tenants_prefixes_and_no_value_holds_their_plaintext(
    writer: EngineResult, reference: EngineResult, keys: dict[str, Path]
) -> None:
    assert writer.step("A").token_ids == reference.step("A").token_ids
    key_id = MasterKey.from_file(str(keys["writer"])).key_id
    assert f"current master key id {key_id}" in writer.log and keys["writer"].read_text().strip() not in writer.log
    assert "encryption on (AES-256-GCM per tenant): current master key id" in writer.log
    measured = writer.step("check_mooncake_values_sealed").measured
    assert measured == {"values": 2 * (len(PROMPT_A) // BLOCK_SIZE), "with_plaintext": 0}


def test_a_reader_with_the_tenant_s_salt_hits_and_another_salt_misses(
    writer: EngineResult,
    model: Path,
    cluster: MooncakeCluster,
    keys: dict[str, Path],
    e2e_dir: Path,
    reference: EngineResult,
) -> None:
    del writer  # the pool holds A's and B's chunks, sealed
    steps = [
        generate(PROMPT_A, MAX_TOKENS, "C", cache_salt="tenant-c"),
        generate(PROMPT_A, MAX_TOKENS, "A", cache_salt="tenant-a"),
    ]
    reader = sealed_engine(model, cluster, keys["writer"], e2e_dir / "encryption-reader", steps)
    assert reader.delta("C", HITS) == 0
    assert reader.delta("A", HITS) == FULL_TOKENS
    assert reader.delta("A", DECRYPT_FAILURES) == 0
    assert reader.step("C").token_ids == reader.step("A").token_ids == reference.step("A").token_ids


@pytest.mark.parametrize(("key", "reason"), [("other", "decrypt_other_key"), ("rotated", "decrypt_retired_key")])
def test_a_reader_without_the_writer_s_key_misses_counted_and_gives_the_reference_tokens(
    writer: EngineResult,
    model: Path,
    cluster: MooncakeCluster,
    keys: dict[str, Path],
    e2e_dir: Path,
    reference: EngineResult,
    key: str,
    reason: str,
) -> None:
    del writer
    retired = [MasterKey.from_file(str(keys["writer"])).key_id] if key == "rotated" else []
    steps = [generate(PROMPT_A, MAX_TOKENS, "A", cache_salt="tenant-a")]
    reader = sealed_engine(model, cluster, keys[key], e2e_dir / f"encryption-{key}", steps, retired)
    assert reader.delta("A", HITS) == 0
    assert reader.delta("A", DECRYPT_FAILURES) >= 1
    assert f"(reason {reason}:" in reader.log
    assert reader.step("A").token_ids == reference.step("A").token_ids
    assert keys[key].read_text().strip() not in reader.log
