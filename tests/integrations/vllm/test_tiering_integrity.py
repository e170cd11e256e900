"""vLLM's fs tier behind kvtriton's primary fails closed: a damaged or foreign chunk file is a miss, never a hit.

vLLM's real TieringOffloadingManager and fs tier run on a tmp dir; chunks are
stored by hand (the bytes a worker would copy), cascaded, forgotten by the
primary, and looked up again after one chunk file has been damaged. The good
keys are promoted with their bytes; the damaged one is a miss (the engine
recomputes it), counted in ``vllm:kv_offload_integrity_failures`` under the
tier's label and the reason, and is not promoted again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from tiering_fixtures.configs import key, tiering_config
from tiering_fixtures.fs_round_trip import CHUNK, FS_TIER, PAYLOAD, chunk_file, store
from tiering_fixtures.fs_round_trip import look_up as look_up_keys
from vllm.v1.kv_offload.base import OffloadingManager, ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

import kvtriton._integrity as integrity
from kvtriton._integrity import SEAL_BYTES, IntegrityFault, seal, seal_bytes
from kvtriton.integrations.vllm import KVTritonTieringOffloadingSpec
from kvtriton.integrations.vllm._integrity_report import INTEGRITY_FAILURES, REASON_LABELS
from kvtriton.integrations.vllm._sealed_tiering import HOST_MEMORY_PATH, SealedTieringManager
from kvtriton.integrations.vllm._tiered_spec import KVTritonPrimaryTier
from kvtriton.worker import HostMemoryPath, SharedRegion

FILLS = {1: 0x11, 2: 0x22, 3: 0x33}


VLLM_POLICY: dict[str, object] = {
    "eviction_policy": "LRUCachePolicy",
    "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.lru",
}
"""vLLM's own primary over kvtriton's region: the seal and the check are the orchestrator's, so they hold there too."""


def build(
    managers: list[OffloadingManager], root: Path, policy: dict[str, object] | None = None, **config: object
) -> SealedTieringManager:
    extra: dict[str, object] = {
        "cpu_bytes_to_use": 8 * CHUNK,
        "secondary_tiers": [{**FS_TIER, "root_dir": str(root)}],
        **(policy or {}),
    }
    spec = OffloadingSpecFactory.create_spec(tiering_config(extra, worker_kv_bytes_per_block=2048, **config))  # pyright: ignore[reportArgumentType] -- keyword pass-through
    manager = spec.get_manager()
    assert isinstance(manager, SealedTieringManager)
    managers.append(manager)
    return manager


def store_all(manager: SealedTieringManager) -> None:
    """Store chunks ``key(1..3)`` holding their ``FILLS`` byte (a worker's copy; the seal's room gets sealed),
    cascade them to fs, forget them."""
    store(manager, {index: bytes([fill]) * CHUNK for index, fill in FILLS.items()}, ReqContext(req_id="store"))
    assert all(chunk_file(manager, index).stat().st_size == CHUNK for index in FILLS)


def look_up(manager: SealedTieringManager, request: str) -> dict[int, bytes | None]:
    return look_up_keys(manager, tuple(FILLS), ReqContext(req_id=request))


def intact(index: int) -> bytes:
    return bytes([FILLS[index]]) * PAYLOAD


def flip_middle(path: Path, manager: SealedTieringManager) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(byte ^ 0xFF for byte in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def copy_key_1_over(path: Path, manager: SealedTieringManager) -> None:
    path.write_bytes(chunk_file(manager, 1).read_bytes())


def older_row_format(path: Path, manager: SealedTieringManager) -> None:
    payload = path.read_bytes()[:PAYLOAD]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(integrity, "ROW_FORMAT_VERSION", integrity.ROW_FORMAT_VERSION - 1)
        path.write_bytes(seal(payload, key=key(2), fingerprint=manager.identity.fingerprint))


def another_fingerprint(path: Path, manager: SealedTieringManager) -> None:
    payload = path.read_bytes()[:PAYLOAD]
    path.write_bytes(seal(payload, key=key(2), fingerprint=bytes(range(16))))


def another_geometry(path: Path, manager: SealedTieringManager) -> None:
    """A longer chunk (two blocks' worth, sealed at its own end) copied in: a file of another length."""
    payload = bytes([0x22]) * (2 * CHUNK - SEAL_BYTES)
    path.write_bytes(payload + seal_bytes(payload, key=key(2), fingerprint=manager.identity.fingerprint))


def truncated(path: Path, manager: SealedTieringManager) -> None:
    path.write_bytes(path.read_bytes()[: CHUNK // 2])


def emptied(path: Path, manager: SealedTieringManager) -> None:
    path.write_bytes(b"")


def appended_to(path: Path, manager: SealedTieringManager) -> None:
    """Bytes after an intact sealed chunk: vLLM's fs tier would read the chunk alone, never what follows."""
    path.write_bytes(path.read_bytes() + b"\xff" * CHUNK)


def never_sealed(path: Path, manager: SealedTieringManager) -> None:
    """vLLM's own primary's bytes for the key (no seal at all), copied into kvtriton's namespace."""
    path.write_bytes(bytes([0x22]) * CHUNK)


DAMAGES: dict[str, tuple[Callable[[Path, SealedTieringManager], None], IntegrityFault]] = {
    "flipped-bytes": (flip_middle, IntegrityFault.CHECKSUM),
    "another-keys-file": (copy_key_1_over, IntegrityFault.OTHER_KEY),
    "older-row-format": (older_row_format, IntegrityFault.STALE_FORMAT),
    "another-fingerprint": (another_fingerprint, IntegrityFault.OTHER_FINGERPRINT),
    "another-geometry": (another_geometry, IntegrityFault.WRONG_SIZE),
    "never-sealed": (never_sealed, IntegrityFault.TORN),
    # Files of another length are caught before vLLM's read, which would fail the first two as its own short read
    # (and the keys after them in its batched read), uncounted, and serve the third.
    "truncated": (truncated, IntegrityFault.TORN),
    "empty": (emptied, IntegrityFault.TORN),
    "over-long": (appended_to, IntegrityFault.WRONG_SIZE),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_faulty_chunk_file_is_a_miss_counted_by_reason_and_the_good_keys_are_still_served(
    managers: list[OffloadingManager], tmp_path: Path, damage: str
) -> None:
    manager = build(managers, tmp_path)
    store_all(manager)
    harm, reason = DAMAGES[damage]
    harm(chunk_file(manager, 2), manager)

    assert look_up(manager, "after-damage") == {1: intact(1), 2: None, 3: intact(3)}
    (report,) = manager.integrity
    assert report.tier_label == "1:fs" and report.counts() == {
        label: int(label == reason.value) for label in REASON_LABELS
    }
    assert not chunk_file(manager, 2).exists()  # removed, as vLLM's fs tier removes a file cut short
    stats = manager.get_stats()
    assert stats is not None
    assert stats.reduce()[f"{INTEGRITY_FAILURES}:{('1:fs', reason.value)}"] == 1

    # Asked again, key 2 stays a miss, without another faulty read or count.
    assert look_up(manager, "again")[2] is None
    assert report.total() == 1


def test_behind_vllms_own_primary_a_faulty_chunk_is_a_miss_too(
    managers: list[OffloadingManager], tmp_path: Path
) -> None:
    manager = build(managers, tmp_path, VLLM_POLICY)
    assert type(manager.primary_tier).__name__ == "CPUPrimaryTierOffloadingManager"
    store_all(manager)
    copy_key_1_over(chunk_file(manager, 2), manager)
    assert look_up(manager, "after-damage") == {1: intact(1), 2: None, 3: intact(3)}
    assert manager.integrity[0].counts()[IntegrityFault.OTHER_KEY.value] == 1


def test_a_key_that_failed_is_promoted_again_once_this_engine_stored_it_afresh(
    managers: list[OffloadingManager], tmp_path: Path
) -> None:
    manager = build(managers, tmp_path)
    store_all(manager)
    flip_middle(chunk_file(manager, 2), manager)
    assert look_up(manager, "after-damage")[2] is None
    store_all(manager)  # the engine recomputed the chunks and stores them: the cascade writes key 2's file afresh
    assert look_up(manager, "after-the-new-store") == {index: intact(index) for index in FILLS}
    assert manager.integrity[0].total() == 1


def test_another_identity_files_its_chunks_in_another_directory_so_a_redeployed_model_plainly_misses(
    managers: list[OffloadingManager], tmp_path: Path
) -> None:
    writer = build(managers, tmp_path, model_name="models/llama")
    store_all(writer)
    reader = build(managers, tmp_path, model_name="models/llama")
    assert reader.identity.fingerprint == writer.identity.fingerprint  # the same identity: its chunks are found
    assert look_up(reader, "same")[1] == intact(1)
    other = build(managers, tmp_path, model_name="models/llama-finetune")
    assert look_up(other, "other") == dict.fromkeys(FILLS)
    assert other.integrity[0].total() == 0  # nothing read: another directory
    # Two namespaces side by side under the root, each named after its identity; only the writer's holds chunks.
    namespaces = {path.name.removesuffix("_r0") for path in tmp_path.iterdir()}
    assert len(namespaces) == 2
    assert {any(f"@id-{one.identity.hex}_" in name for name in namespaces) for one in (writer, other)} == {True}
    assert all(f"@id-{writer.identity.hex}_" in path.relative_to(tmp_path).parts[0] for path in tmp_path.rglob("*.bin"))


def test_the_seal_is_written_when_a_tier_is_handed_the_slot_and_the_worker_bytes_stay_as_they_were(
    managers: list[OffloadingManager], tmp_path: Path
) -> None:
    manager = build(managers, tmp_path)
    store_all(manager)
    for index in FILLS:
        want = seal(intact(index), key=key(index), fingerprint=manager.identity.fingerprint)
        assert chunk_file(manager, index).read_bytes() == want


def test_the_tiered_spec_declares_the_integrity_metric_by_tier_and_reason() -> None:
    from kvtriton.integrations.vllm import KVTritonTieringOffloadingSpec

    metric = KVTritonTieringOffloadingSpec.build_metric_definitions({"secondary_tiers": []})[INTEGRITY_FAILURES]
    assert tuple(metric.labelnames) == ("tier", "reason")


def test_the_tiered_manager_reports_the_host_memory_path_its_ranks_took(
    managers: list[OffloadingManager], tmp_path: Path
) -> None:
    manager = build(managers, tmp_path)
    assert HOST_MEMORY_PATH in KVTritonTieringOffloadingSpec.build_metric_definitions({})

    def gauge() -> float | None:
        stats = manager.get_stats()
        return None if stats is None else stats.reduce().get(HOST_MEMORY_PATH)

    assert gauge() is None  # no rank has taken its slab yet
    primary = manager.primary_tier
    assert isinstance(primary, KVTritonPrimaryTier) and isinstance(primary.region, SharedRegion)
    primary.region.rank_slab(0, pin=False).close()  # this machine has no CUDA: the rank's copies are pageable
    assert gauge() == int(HostMemoryPath.PAGEABLE) == 2
