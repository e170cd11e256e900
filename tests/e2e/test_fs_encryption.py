"""``kvtriton_encryption`` with real engines across processes and vLLM's ``fs`` tier: every chunk file is sealed.

A writer stores a prefix under tenants A and B (each request's ``cache_salt``)
through the egress area. An unencrypted run of the same prompts, under the
same salts, files the same chunks under the same names in a root of its own:
its files hold the plaintext, and no file of the writer holds any 64-byte run
of the plaintext of the file it pairs with. A reader with the same master key
and A's salt hits and gives the reference tokens; with C's salt it misses. A
reader started with another master key, and one whose key rotated (the
writer's id retired), miss with counted decrypt failures and give the
reference tokens. Each reader reads a copy of the writer's root: a reader
removes a file it cannot open, as it removes any faulty chunk file. A flipped
byte, a file moved under another key and a retired key id are counted misses
at the orchestrator level too (tests/integrations/vllm/test_tiering_fs_encryption.py).
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.tiny_models import TinyLlama
from e2e.engine import EngineJob, EngineResult, generate, run_engine, spec_config
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

pytest.importorskip("cryptography", reason="encryption needs kvtriton's [encryption] extra")

from kvtriton._integrity import SEAL_BYTES
from kvtriton.encryption import MasterKey

HITS = "vllm:external_prefix_cache_hits"
DECRYPT_FAILURES = "vllm:kv_offload_integrity_failures"
FULL_TOKENS = len(PROMPT_A) // BLOCK_SIZE * BLOCK_SIZE
PROMPT_B = PROMPT_A[::-1]  # another prefix, in the tiny model's vocabulary
RUN = 64
"""No chunk file may hold a run of this many bytes of its plaintext."""


def key_file(folder: Path, name: str) -> Path:
    """A fresh master key in a file of the server's user alone, as docs/security.md says to make one."""
    path = folder / name
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def fs_engine(
    model: Path,
    root: Path,
    workdir: Path,
    steps: Sequence[dict[str, object]],
    key: Path | None,
    retired: Sequence[str] = (),
) -> EngineResult:
    """An engine on the fs root ``root``, encrypting with ``key`` (None: not encrypting)."""
    extra: dict[str, object] = {
        "cpu_bytes_to_use": 8 << 20,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
    }
    if key is not None:
        extra["kvtriton_encryption"] = {"master_key_file": str(key), "retired_key_ids": list(retired)}
    config = spec_config("KVTritonTieringOffloadingSpec", **extra)
    return run_engine(EngineJob(model=str(model), steps=list(steps), kv_transfer_config=config), workdir)


def chunk_files(root: Path) -> dict[Path, bytes]:
    """Every chunk file under ``root``, by its path relative to it."""
    return {path.relative_to(root): path.read_bytes() for path in sorted(root.rglob("*.bin"))}


def holds_plaintext_run(data: bytes, plain: bytes) -> bool:
    """Whether ``data`` holds any :data:`RUN`-byte run of ``plain``.

    Any such run contains one of ``plain``'s ``RUN // 2``-byte pieces at a multiple of ``RUN // 2``, so ``data``
    is searched for those at every offset (a stricter test than the runs themselves).
    """
    half = RUN // 2
    pieces = {plain[start : start + half] for start in range(0, len(plain) - half + 1, half)}
    return any(data[offset : offset + half] in pieces for offset in range(len(data) - half + 1))


TENANT_STEPS = (
    generate(PROMPT_A, MAX_TOKENS, "A", cache_salt="tenant-a"),
    generate(PROMPT_B, MAX_TOKENS, "B", cache_salt="tenant-b"),
)


@pytest.fixture(scope="module")
def keys(e2e_dir: Path) -> dict[str, Path]:
    folder = e2e_dir / "fs-encryption-keys"
    folder.mkdir(exist_ok=True)
    return {name: key_file(folder, f"{name}.key") for name in ("writer", "other", "rotated")}


@pytest.fixture(scope="module")
def model(e2e_dir: Path) -> Path:
    return TinyLlama().write(e2e_dir / "fs-encryption-llama")


@pytest.fixture(scope="module")
def sealed_root(e2e_dir: Path) -> Path:
    return e2e_dir / "fs-encryption-root"


@pytest.fixture(scope="module")
def writer(model: Path, sealed_root: Path, keys: dict[str, Path], e2e_dir: Path) -> EngineResult:
    return fs_engine(model, sealed_root, e2e_dir / "fs-encryption-writer", TENANT_STEPS, keys["writer"])


def reader_root(sealed_root: Path, e2e_dir: Path, name: str) -> Path:
    """A copy of the writer's root for one reader (a reader removes the files it cannot open)."""
    copy = e2e_dir / f"fs-encryption-root-{name}"
    shutil.copytree(sealed_root, copy)
    return copy


def test_no_chunk_file_holds_a_run_of_the_plaintext_an_unencrypted_run_files_under_its_name(
    writer: EngineResult, model: Path, sealed_root: Path, keys: dict[str, Path], e2e_dir: Path, reference: EngineResult
) -> None:
    assert writer.step("A").token_ids == reference.step("A").token_ids
    key_id = MasterKey.from_file(str(keys["writer"])).key_id
    assert f"current master key id {key_id}" in writer.log and keys["writer"].read_text().strip() not in writer.log
    assert "vLLM's fs tier gets only sealed chunks, through an egress area" in writer.log
    plain_root = e2e_dir / "fs-encryption-plaintext-root"
    plain = fs_engine(model, plain_root, e2e_dir / "fs-encryption-plaintext", TENANT_STEPS, None)
    assert plain.step("B").token_ids == writer.step("B").token_ids
    sealed, plaintext = chunk_files(sealed_root), chunk_files(plain_root)
    assert len(sealed) == 2 * (len(PROMPT_A) // BLOCK_SIZE)  # both tenants' chunks, one file each
    assert sealed.keys() == plaintext.keys()  # the same chunks under the same names: each pairs with its plaintext
    for name, data in sealed.items():
        kv = plaintext[name][:-SEAL_BYTES]  # the unencrypted file: the chunk's KV, then its xxh3 seal
        assert len(data) == len(plaintext[name])  # a sealed box is one slot, as a sealed chunk is
        assert any(kv) and holds_plaintext_run(plaintext[name], kv)  # the check finds plaintext where it is
        assert not holds_plaintext_run(data, kv), name


def test_a_reader_with_the_tenant_s_salt_hits_and_another_salt_misses(
    writer: EngineResult,
    model: Path,
    sealed_root: Path,
    keys: dict[str, Path],
    e2e_dir: Path,
    reference: EngineResult,
) -> None:
    del writer  # the root holds A's and B's chunks, sealed
    steps = [
        generate(PROMPT_A, MAX_TOKENS, "C", cache_salt="tenant-c"),
        generate(PROMPT_A, MAX_TOKENS, "A", cache_salt="tenant-a"),
    ]
    root = reader_root(sealed_root, e2e_dir, "reader")
    reader = fs_engine(model, root, e2e_dir / "fs-encryption-reader", steps, keys["writer"])
    assert reader.delta("C", HITS) == 0
    assert reader.delta("A", HITS) == FULL_TOKENS
    assert reader.delta("A", DECRYPT_FAILURES) == 0
    assert reader.step("C").token_ids == reader.step("A").token_ids == reference.step("A").token_ids


@pytest.mark.parametrize(("key", "reason"), [("other", "decrypt_other_key"), ("rotated", "decrypt_retired_key")])
def test_a_reader_without_the_writer_s_key_misses_counted_and_gives_the_reference_tokens(
    writer: EngineResult,
    model: Path,
    sealed_root: Path,
    keys: dict[str, Path],
    e2e_dir: Path,
    reference: EngineResult,
    key: str,
    reason: str,
) -> None:
    del writer
    retired = [MasterKey.from_file(str(keys["writer"])).key_id] if key == "rotated" else []
    steps = [generate(PROMPT_A, MAX_TOKENS, "A", cache_salt="tenant-a")]
    root = reader_root(sealed_root, e2e_dir, key)
    reader = fs_engine(model, root, e2e_dir / f"fs-encryption-{key}", steps, keys[key], retired)
    assert reader.delta("A", HITS) == 0
    assert reader.delta("A", DECRYPT_FAILURES) >= 1
    assert f"(reason {reason}:" in reader.log
    assert reader.step("A").token_ids == reference.step("A").token_ids
    assert keys[key].read_text().strip() not in reader.log
