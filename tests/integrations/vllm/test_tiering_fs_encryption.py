"""vLLM's fs tier behind kvtriton's primary with ``kvtriton_encryption``: it is handed ciphertext, never plaintext.

vLLM's real TieringOffloadingManager and fs tier run on a tmp dir, as in
test_tiering_integrity.py: chunks are stored by hand under a tenant (the
``RequestTenant`` the connector's hook records), cascaded through the egress
area, forgotten by the primary and looked up again. A reader of the tenant
gets the chunks back; no chunk file holds a 64-byte run of its plaintext (the
same check finds it in every file of an unencrypted run); another tenant,
another master key, a retired key id, a flipped byte and a file moved under
another key's name are each a miss counted as ``decrypt_<reason>``, the slot
never served.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")
pytest.importorskip("cryptography", reason="encryption needs kvtriton's [encryption] extra")

from plaintext_runs import holds_plaintext_run
from tiering_fixtures.configs import drain, key, tiering_config
from tiering_fixtures.fs_round_trip import CHUNK, FS_TIER, PAYLOAD, chunk_file, store
from tiering_fixtures.fs_round_trip import look_up as look_up_keys
from vllm.v1.kv_offload.base import OffloadingManager, ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

import kvtriton.integrations.vllm._egress as egress
from kvtriton.encryption import MasterKey
from kvtriton.integrations.vllm import RequestTenant
from kvtriton.integrations.vllm._sealed_tiering import SealedTieringManager

KEYS = (1, 2, 3)


def plaintext(index: int) -> bytes:
    """Key ``index``'s KV: bytes no ciphertext reproduces by chance, as a model's KV are."""
    return np.random.default_rng(index).integers(0, 256, PAYLOAD, dtype=np.uint8).tobytes()


def master_key_file(folder: Path, name: str) -> Path:
    path = folder / f"{name}.key"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def build(
    managers: list[OffloadingManager], root: Path, key_path: Path | None, retired: tuple[str, ...] = ()
) -> SealedTieringManager:
    extra: dict[str, object] = {
        "cpu_bytes_to_use": 8 * CHUNK,
        "secondary_tiers": [{**FS_TIER, "root_dir": str(root)}],
    }
    if key_path is not None:
        extra["kvtriton_encryption"] = {"master_key_file": str(key_path), "retired_key_ids": list(retired)}
    spec = OffloadingSpecFactory.create_spec(tiering_config(extra))
    manager = spec.get_manager()
    assert isinstance(manager, SealedTieringManager)
    managers.append(manager)
    return manager


def context_of(request: str, tenant: str | None) -> ReqContext:
    """A request's context as the connector builds it, with the tenant kvtriton's hook records."""
    context = ReqContext(req_id=request)
    context.set_state(RequestTenant(tenant))
    return context


def store_all(manager: SealedTieringManager, tenant: str | None) -> None:
    """Store ``key(1..3)`` holding their :func:`plaintext` (a worker's copy), cascade them to fs, forget them."""
    store(manager, {index: plaintext(index) for index in KEYS}, context_of("store", tenant))


def look_up(manager: SealedTieringManager, tenant: str | None) -> dict[int, bytes | None]:
    """Each key's promoted KV, or None for a miss."""
    return look_up_keys(manager, KEYS, context_of(f"read-{time.monotonic_ns()}", tenant))


def failures(manager: SealedTieringManager) -> dict[str, int]:
    return {reason: count for reason, count in manager.integrity[0].counts().items() if count}


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "keys"
    folder.mkdir()
    return folder


def test_a_tenant_s_chunks_round_trip_through_sealed_files(
    managers: list[OffloadingManager], tmp_path: Path, keys_dir: Path
) -> None:
    writer_key = master_key_file(keys_dir, "writer")
    writer = build(managers, tmp_path / "fs", writer_key)
    store_all(writer, "tenant-a")
    assert all(chunk_file(writer, index).stat().st_size == CHUNK for index in KEYS)  # a box is exactly one slot
    reader = build(managers, tmp_path / "fs", writer_key)
    assert look_up(reader, "tenant-a") == {index: plaintext(index) for index in KEYS}
    assert failures(reader) == {} and reader.egress_left_out == 0


@pytest.mark.parametrize("encrypted", [True, False])
def test_no_chunk_file_holds_a_run_of_its_plaintext_and_unencrypted_every_one_does(
    managers: list[OffloadingManager], tmp_path: Path, keys_dir: Path, encrypted: bool
) -> None:
    manager = build(managers, tmp_path / "fs", master_key_file(keys_dir, "writer") if encrypted else None)
    store_all(manager, "tenant-a")
    found = [holds_plaintext_run(chunk_file(manager, index).read_bytes(), plaintext(index)) for index in KEYS]
    assert found == [not encrypted] * len(KEYS)


def moved_under_key_2(reader: SealedTieringManager) -> None:
    """Key 1's intact sealed file, put where key 2's belongs."""
    chunk_file(reader, 2).write_bytes(chunk_file(reader, 1).read_bytes())


def flipped(reader: SealedTieringManager) -> None:
    path = chunk_file(reader, 2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("harm", "reason"), [(flipped, "decrypt_tag_mismatch"), (moved_under_key_2, "decrypt_tag_mismatch")]
)
def test_a_damaged_or_moved_file_is_a_counted_miss_and_the_others_are_served(
    managers: list[OffloadingManager], tmp_path: Path, keys_dir: Path, harm: object, reason: str
) -> None:
    writer_key = master_key_file(keys_dir, "writer")
    store_all(build(managers, tmp_path / "fs", writer_key), "tenant-a")
    reader = build(managers, tmp_path / "fs", writer_key)
    assert callable(harm)
    harm(reader)
    assert look_up(reader, "tenant-a") == {1: plaintext(1), 2: None, 3: plaintext(3)}
    assert failures(reader) == {reason: 1}
    assert not chunk_file(reader, 2).exists()  # dropped, so that the next cascade writes it afresh
    assert look_up(reader, "tenant-a")[2] is None and failures(reader) == {reason: 1}  # quarantined: not read again


@pytest.mark.parametrize("reader_is", ["another tenant", "another master key", "the writer's key retired"])
def test_a_reader_without_the_tenant_s_key_misses_every_chunk_counted(
    managers: list[OffloadingManager], tmp_path: Path, keys_dir: Path, reader_is: str
) -> None:
    writer_key = master_key_file(keys_dir, "writer")
    store_all(build(managers, tmp_path / "fs", writer_key), "tenant-a")
    tenant, key_path, retired, reason = {
        "another tenant": ("tenant-c", writer_key, (), "decrypt_tag_mismatch"),
        "another master key": ("tenant-a", master_key_file(keys_dir, "other"), (), "decrypt_other_key"),
        "the writer's key retired": (
            "tenant-a",
            master_key_file(keys_dir, "rotated"),
            (MasterKey.from_file(str(writer_key)).key_id,),
            "decrypt_retired_key",
        ),
    }[reader_is]
    reader = build(managers, tmp_path / "fs", key_path, retired)
    assert look_up(reader, tenant) == dict.fromkeys(KEYS)
    assert failures(reader) == {reason: len(KEYS)}


def test_a_request_without_a_tenant_stores_nothing(
    managers: list[OffloadingManager], tmp_path: Path, keys_dir: Path
) -> None:
    manager = build(managers, tmp_path / "fs", master_key_file(keys_dir, "writer"))
    context = ReqContext(req_id="no-tenant")  # built without kvtriton's hook: it names no tenant
    manager.on_new_request(context)
    with manager.lock:
        output = manager.prepare_store([key(1)], context)
        assert output is not None
        manager.complete_store([key(1)], context)
    drain(manager)
    assert not chunk_file(manager, 1).exists() and manager.egress_left_out == 1


def test_chunks_beyond_the_free_egress_rows_are_not_stored_and_the_rest_round_trip(
    managers: list[OffloadingManager], tmp_path: Path, keys_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(egress, "EGRESS_MIN_ROWS", 1)
    monkeypatch.setattr(egress, "EGRESS_BYTES", CHUNK)
    writer_key = master_key_file(keys_dir, "writer")
    writer = build(managers, tmp_path / "fs", writer_key)
    store_all(writer, "tenant-a")  # one job of three chunks, one egress row: one chunk stored, two skipped
    assert [chunk_file(writer, index).exists() for index in KEYS] == [True, False, False]
    assert writer.egress_left_out == 2
    reader = build(managers, tmp_path / "fs", writer_key)
    assert look_up(reader, "tenant-a") == {1: plaintext(1), 2: None, 3: None}
    assert failures(reader) == {}


def test_the_egress_area_is_bounded_and_reuses_the_rows_given_back_last() -> None:
    assert egress.egress_rows(8, CHUNK) == 8  # a small region: one row per chunk at most
    assert egress.egress_rows(1 << 20, 2 << 20) == 512  # 1 GiB of 2 MiB chunks
    assert egress.egress_rows(1 << 20, 64 << 20) == 64  # huge chunks: still room for a long prompt's
    area = egress.EgressArea(4, CHUNK)
    assert area.view().shape == (4, CHUNK) and area.rows.ctypes.data % 4096 == 0  # O_DIRECT needs aligned rows
    first = area.take(3)
    assert area.take(5) == [3] and area.free == 0  # fewer than asked when fewer are free
    area.give_back(first)
    assert area.take(3) == first  # the rows touched last come back first: the pages resident stay few
