"""``kvtriton_encryption`` with real engines across processes, through kvtriton's Mooncake tier and vLLM's ``fs`` tier.

Per tier, a writer stores a prefix under tenants A and B (each request's
``cache_salt``), and nothing the tier holds carries its plaintext:

* Mooncake: no pool value holds any 64-byte run of the chunk it was made
  from (test_mooncake.py's unencrypted writer, same prompt, finds every value
  does);
* fs (through the egress area): an unencrypted run of the same prompts, under
  the same salts, files the same chunks under the same names in a root of its
  own; its files hold the plaintext, and no file of the writer holds any
  64-byte run of the plaintext of the file it pairs with.

Then, on either tier, a reader with the same master key and A's salt hits and
gives the reference tokens; with C's salt it misses. A reader started with
another master key, and one whose key rotated (the writer's id retired), miss
with counted decrypt failures and give the reference tokens. An fs reader
reads a copy of the writer's root: a reader removes a file it cannot open, as
it removes any faulty chunk file. A flipped byte, an object moved under
another key and a retired key id are counted misses below the engine too
(tests/integrations/remote/test_tier_remote_encryption.py,
tests/integrations/vllm/test_tiering_fs_encryption.py); a key file others may
read stops the start with one line (tests/integrations/vllm/test_encryption_setting.py).
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from mooncake_fixtures import MOONCAKE_MISSING

from bench.tiny_models import TinyLlama
from e2e.engine import (
    CHECK_MOONCAKE_VALUES_SEALED,
    DAMAGE_MOONCAKE_VALUES,
    WAIT_TIERS_UP,
    EngineJob,
    EngineResult,
    generate,
    run_engine,
    spec_config,
)
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

pytest.importorskip("cryptography", reason="encryption needs kvtriton's [encryption] extra")

# The fixture by its own name (`x as x`: imported for pytest to find, not to call).
from mooncake_fixtures.managers import cluster as cluster
from plaintext_runs import holds_plaintext_run

from kvtriton._integrity import SEAL_BYTES
from kvtriton.encryption import MasterKey

HITS = "vllm:external_prefix_cache_hits"
DECRYPT_FAILURES = "vllm:kv_offload_integrity_failures"
FULL_TOKENS = len(PROMPT_A) // BLOCK_SIZE * BLOCK_SIZE
PROMPT_B = PROMPT_A[::-1]  # another prefix, in the tiny model's vocabulary
TENANT_STEPS = (
    generate(PROMPT_A, MAX_TOKENS, "A", cache_salt="tenant-a"),
    generate(PROMPT_B, MAX_TOKENS, "B", cache_salt="tenant-b"),
)


def key_file(folder: Path, name: str) -> Path:
    """A fresh master key in a file of the server's user alone, as docs/security.md says to make one."""
    path = folder / name
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def encrypted_engine(
    model: Path,
    tier: dict[str, object],
    key: Path | None,
    workdir: Path,
    steps: Sequence[dict[str, object]],
    retired: Sequence[str] = (),
) -> EngineResult:
    """An engine with ``tier`` behind its host memory, encrypting with ``key`` (None: not encrypting)."""
    extra: dict[str, object] = {"cpu_bytes_to_use": 8 << 20, "secondary_tiers": [tier]}
    if key is not None:
        extra["kvtriton_encryption"] = {"master_key_file": str(key), "retired_key_ids": list(retired)}
    config = spec_config("KVTritonTieringOffloadingSpec", **extra)
    return run_engine(EngineJob(model=str(model), steps=[WAIT_TIERS_UP, *steps], kv_transfer_config=config), workdir)


@dataclass(frozen=True)
class SealedTier:
    """One tier under test: how an engine on it starts, given its key, work folder name, steps and retired ids."""

    name: str
    engine: Callable[[Path | None, str, Sequence[dict[str, object]], Sequence[str]], EngineResult]


@pytest.fixture(scope="module")
def keys(e2e_dir: Path) -> dict[str, Path]:
    folder = e2e_dir / "encryption-keys"
    folder.mkdir(exist_ok=True)
    return {name: key_file(folder, f"{name}.key") for name in ("writer", "other", "rotated")}


@pytest.fixture(scope="module")
def model(e2e_dir: Path) -> Path:
    return TinyLlama().write(e2e_dir / "encryption-llama")


@pytest.fixture(scope="module", params=["mooncake", "fs"])
def tier(request: pytest.FixtureRequest, model: Path, e2e_dir: Path) -> SealedTier:
    """The tier of this module's half: Mooncake (one pool for its engines) or fs (a copy of the writer's root for
    each reader, which removes the files it cannot open)."""
    if request.param == "mooncake":
        if MOONCAKE_MISSING is not None:
            pytest.skip(MOONCAKE_MISSING)
        address = request.getfixturevalue("cluster").master_address
        entry: dict[str, object] = {
            "type": "MooncakeStoreTier",
            "module_path": "kvtriton.integrations.mooncake",
            "master_server_address": address,
            "namespace": "sealed",
            "timeout_s": 5.0,
            "io_threads": 2,
        }

        def on_mooncake(
            key: Path | None, name: str, steps: Sequence[dict[str, object]], retired: Sequence[str]
        ) -> EngineResult:
            return encrypted_engine(model, entry, key, e2e_dir / f"encryption-{name}", steps, retired)

        return SealedTier("mooncake", on_mooncake)
    writer_root = e2e_dir / "encryption-fs-root"

    def on_fs(key: Path | None, name: str, steps: Sequence[dict[str, object]], retired: Sequence[str]) -> EngineResult:
        root = writer_root if name == "writer" else e2e_dir / f"encryption-fs-root-{name}"
        if name not in ("writer", "plaintext"):
            shutil.copytree(writer_root, root)
        entry: dict[str, object] = {"type": "fs", "root_dir": str(root)}
        return encrypted_engine(model, entry, key, e2e_dir / f"encryption-fs-{name}", steps, retired)

    return SealedTier("fs", on_fs)


@pytest.fixture(scope="module")
def writer(tier: SealedTier, keys: dict[str, Path]) -> EngineResult:
    checks = [CHECK_MOONCAKE_VALUES_SEALED] if tier.name == "mooncake" else []
    return tier.engine(keys["writer"], "writer", [*TENANT_STEPS, *checks], ())


def chunk_files(root: Path) -> dict[Path, bytes]:
    """Every chunk file under ``root``, by its path relative to it."""
    return {path.relative_to(root): path.read_bytes() for path in sorted(root.rglob("*.bin"))}


def test_the_writer_stores_both_tenants_prefixes_and_nothing_the_tier_holds_carries_their_plaintext(
    tier: SealedTier, writer: EngineResult, reference: EngineResult, keys: dict[str, Path], e2e_dir: Path
) -> None:
    assert writer.step("A").token_ids == reference.step("A").token_ids
    key_id = MasterKey.from_file(str(keys["writer"])).key_id
    assert f"current master key id {key_id}" in writer.log and keys["writer"].read_text().strip() not in writer.log
    assert "encryption on (AES-256-GCM per tenant): current master key id" in writer.log
    if tier.name == "mooncake":
        measured = writer.step("check_mooncake_values_sealed").measured
        assert measured == {"values": 2 * (len(PROMPT_A) // BLOCK_SIZE), "with_plaintext": 0}
        return
    assert "vLLM's fs tier gets only sealed chunks, through an egress area" in writer.log
    plain = tier.engine(None, "plaintext", TENANT_STEPS, ())
    assert plain.step("B").token_ids == writer.step("B").token_ids
    sealed = chunk_files(e2e_dir / "encryption-fs-root")
    plaintext = chunk_files(e2e_dir / "encryption-fs-root-plaintext")
    assert len(sealed) == 2 * (len(PROMPT_A) // BLOCK_SIZE)  # both tenants' chunks, one file each
    assert sealed.keys() == plaintext.keys()  # the same chunks under the same names: each pairs with its plaintext
    for name, data in sealed.items():
        kv = plaintext[name][:-SEAL_BYTES]  # the unencrypted file: the chunk's KV, then its xxh3 seal
        assert len(data) == len(plaintext[name])  # a sealed box is one slot, as a sealed chunk is
        assert any(kv) and holds_plaintext_run(plaintext[name], kv)  # the check finds plaintext where it is
        assert not holds_plaintext_run(data, kv), name


def test_a_reader_with_the_tenant_s_salt_hits_and_another_salt_misses(
    tier: SealedTier, writer: EngineResult, keys: dict[str, Path], reference: EngineResult
) -> None:
    del writer  # the tier holds A's and B's chunks, sealed
    steps = [
        generate(PROMPT_A, MAX_TOKENS, "C", cache_salt="tenant-c"),
        generate(PROMPT_A, MAX_TOKENS, "A", cache_salt="tenant-a"),
    ]
    reader = tier.engine(keys["writer"], "reader", steps, ())
    assert reader.delta("C", HITS) == 0
    assert reader.delta("A", HITS) == FULL_TOKENS
    assert reader.delta("A", DECRYPT_FAILURES) == 0
    assert reader.step("C").token_ids == reader.step("A").token_ids == reference.step("A").token_ids


@pytest.mark.parametrize(("key", "reason"), [("other", "decrypt_other_key"), ("rotated", "decrypt_retired_key")])
def test_a_reader_without_the_writer_s_key_misses_counted_and_gives_the_reference_tokens(
    tier: SealedTier, writer: EngineResult, keys: dict[str, Path], reference: EngineResult, key: str, reason: str
) -> None:
    del writer
    retired = [MasterKey.from_file(str(keys["writer"])).key_id] if key == "rotated" else []
    reader = tier.engine(keys[key], key, [generate(PROMPT_A, MAX_TOKENS, "A", cache_salt="tenant-a")], retired)
    assert reader.delta("A", HITS) == 0
    assert reader.delta("A", DECRYPT_FAILURES) >= 1
    assert f"(reason {reason}:" in reader.log
    assert reader.step("A").token_ids == reference.step("A").token_ids
    assert keys[key].read_text().strip() not in reader.log


def test_a_flipped_byte_in_what_the_tier_holds_is_a_counted_miss_and_the_reference_tokens(
    tier: SealedTier, writer: EngineResult, keys: dict[str, Path], reference: EngineResult, e2e_dir: Path
) -> None:
    """Last in the module: it damages what the writer left. Mooncake: an engine of the same tenant flips 64 bytes in
    the middle of each of its values in the pool; fs: one byte in the middle of each chunk file of a reader's copy."""
    del writer
    steps = [generate(PROMPT_A, MAX_TOKENS, "A", cache_salt="tenant-a")]
    if tier.name == "mooncake":
        tier.engine(keys["writer"], "damager", [*steps, DAMAGE_MOONCAKE_VALUES], ())
        reader = tier.engine(keys["writer"], "after-damage", steps, ())
    else:

        def flip_every_chunk_file(root: Path) -> None:
            for path in root.rglob("*.bin"):
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))

        flip_every_chunk_file(e2e_dir / "encryption-fs-root")  # every reader before this one had its own copy
        reader = tier.engine(keys["writer"], "after-damage", steps, ())
    assert reader.delta("A", HITS) == 0
    assert reader.delta("A", DECRYPT_FAILURES) >= 1
    assert "(reason decrypt_tag_mismatch:" in reader.log
    assert reader.step("A").token_ids == reference.step("A").token_ids
