"""A remote tier behind an encrypting spec (``kvtriton_encryption``): every value is a sealed box of its tenant.

Over the in-memory store (the same base as Mooncake's tier): no value holds
any 64-byte run of the chunk it was made from; a reader with the tenant's key
gets the chunk back bit-exact; every other reading (another tenant, another
master key, a retired key id, a flipped byte, a value moved under another
key, a plaintext tier's value) is a miss counted by its own reason, with the
primary slot left holding nothing of the value; a job whose request names no
tenant is refused without touching the store.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")
pytest.importorskip("cryptography", reason="encryption needs kvtriton's [encryption] extra")

from mooncake_fixtures.managers import promote, serve_and_cascade
from mooncake_fixtures.tiers import Primary, chunk_keys, make_memory_tier, resolve_lookups, run_job
from plaintext_runs import holds_plaintext_run
from tiering_fixtures.configs import managers as managers
from tiering_fixtures.configs import tiering
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvtriton.encryption import MasterKey, sealed_length
from kvtriton.integrations.remote import InMemoryStoreTier, RemoteTier, in_memory_store
from kvtriton.integrations.vllm import ENCRYPTING_TIER_ATTRIBUTE, RequestTenant, TierEncryption
from kvtriton.integrations.vllm._integrity_report import INTEGRITY_FAILURES
from kvtriton.integrations.vllm._tiered_spec import KVTritonPrimaryTier

CHUNK = 16 * 1024
ALICE, BOB = RequestTenant("alice"), RequestTenant(None)
MASTER = MasterKey(bytes(range(32)), source="test key")
OTHER_MASTER = MasterKey(bytes(range(1, 33)), source="another test key")


@pytest.fixture
def tiers() -> Iterator[list[InMemoryStoreTier]]:
    made: list[InMemoryStoreTier] = []
    yield made
    for tier in made:
        tier.shutdown()


def fresh_store() -> str:
    return f"sealed-{uuid.uuid4().hex[:8]}"


def encrypting(master: MasterKey = MASTER, retired: tuple[str, ...] = ()) -> TierEncryption:
    return TierEncryption(master, retired)


def stored_values(store_name: str) -> dict[str, bytes]:
    store = in_memory_store(store_name)
    values = {key: store.value(key) for key in store.keys() if not key.endswith("/manifest")}
    return {key: value for key, value in values.items() if value is not None}


def integrity_metric(tier: InMemoryStoreTier, reason: str) -> float:
    values = {key: float(value) for key, value in tier.get_stats().reduce().items()}
    return values.get(f"{INTEGRITY_FAILURES}:{(tier.tier_label, reason)}", 0.0)


def test_every_remote_tier_declares_that_it_seals_per_tenant() -> None:
    assert getattr(RemoteTier, ENCRYPTING_TIER_ATTRIBUTE) is True
    assert getattr(InMemoryStoreTier, ENCRYPTING_TIER_ATTRIBUTE) is True


def test_a_tenant_s_chunks_are_stored_as_sealed_boxes_and_come_back_bit_exact(tiers: list[InMemoryStoreTier]) -> None:
    name = fresh_store()
    writer_memory, reader_memory = Primary(4, CHUNK), Primary(4, CHUNK)
    writer = make_memory_tier(name, writer_memory, encryption=encrypting())
    reader = make_memory_tier(name, reader_memory, encryption=encrypting())
    tiers += [writer, reader]
    keys = chunk_keys(2, salt=1)
    written = writer_memory.fill([0, 2], seed=1)

    assert run_job(writer, keys, [0, 2], load=False, tenant=ALICE).success
    values = stored_values(name)
    assert len(values) == 2 and {len(value) for value in values.values()} == {sealed_length(CHUNK)}
    for value in values.values():
        assert not any(holds_plaintext_run(value, chunk) for chunk in written)
    assert writer.stats().stored_keys == 2

    assert resolve_lookups(reader, keys) == [LookupResult.HIT, LookupResult.HIT]
    assert run_job(reader, keys, [3, 1], load=True, tenant=ALICE).success
    assert [reader_memory.chunk(3), reader_memory.chunk(1)] == written
    assert reader.integrity.total() == 0


def test_an_unencrypted_tier_s_values_would_hold_the_plaintext(tiers: list[InMemoryStoreTier]) -> None:
    """The comparison the run check needs: the same chunk through a tier without encryption is there in the clear."""
    name = fresh_store()
    memory = Primary(2, CHUNK)
    tier = make_memory_tier(name, memory)
    tiers.append(tier)
    (written,) = memory.fill([0], seed=3)
    assert run_job(tier, chunk_keys(1, salt=3), [0], load=False).success
    (value,) = stored_values(name).values()
    assert holds_plaintext_run(value, written)


@pytest.mark.parametrize(
    ("reader_encryption", "reader_tenant", "reason"),
    [
        (encrypting(), BOB, "decrypt_tag_mismatch"),  # another tenant's key
        (encrypting(OTHER_MASTER), ALICE, "decrypt_other_key"),  # a server started with another master key
        (encrypting(OTHER_MASTER, retired=(MASTER.key_id,)), ALICE, "decrypt_retired_key"),  # rotated
    ],
    ids=["other-tenant", "other-master-key", "retired-key-id"],
)
def test_a_reader_without_the_tenant_s_key_misses_counted_by_reason_and_its_slot_holds_nothing(
    tiers: list[InMemoryStoreTier], reader_encryption: TierEncryption, reader_tenant: RequestTenant, reason: str
) -> None:
    name = fresh_store()
    writer_memory, reader_memory = Primary(2, CHUNK), Primary(2, CHUNK)
    writer = make_memory_tier(name, writer_memory, encryption=encrypting())
    reader = make_memory_tier(name, reader_memory, encryption=reader_encryption)
    tiers += [writer, reader]
    keys = chunk_keys(1, salt=4)
    writer_memory.fill([0], seed=4)
    assert run_job(writer, keys, [0], load=False, tenant=ALICE).success

    result = run_job(reader, keys, [1], load=True, tenant=reader_tenant)
    assert not result.success
    assert reader.integrity.counts()[reason] == 1 and reader.integrity.total() == 1
    assert integrity_metric(reader, reason) == 1
    assert not reader_memory.rows[1].any()
    assert reader.stats().loaded_keys == 0 and reader.stats().integrity_failures == 1


def test_a_flipped_byte_and_a_value_moved_under_another_key_are_counted_misses(tiers: list[InMemoryStoreTier]) -> None:
    name = fresh_store()
    memory = Primary(4, CHUNK)
    tier = make_memory_tier(name, memory, encryption=encrypting())
    tiers.append(tier)
    keys = chunk_keys(3, salt=5)
    memory.fill([0, 1], seed=5)
    assert run_job(tier, keys[:2], [0, 1], load=False, tenant=ALICE).success
    store = in_memory_store(name)
    first, second, moved_to = (tier.object_key(key) for key in keys)
    flipped = bytearray(store.value(first) or b"")
    flipped[len(flipped) // 2] ^= 0x01
    store.set_value(first, bytes(flipped))
    store.set_value(moved_to, store.value(second) or b"")  # another key's box, filed under this key

    assert not run_job(tier, [keys[0]], [2], load=True, tenant=ALICE).success
    assert not run_job(tier, [keys[2]], [3], load=True, tenant=ALICE).success
    assert tier.integrity.counts()["decrypt_tag_mismatch"] == 2
    assert not memory.rows[2].any() and not memory.rows[3].any()
    assert run_job(tier, [keys[1]], [2], load=True, tenant=ALICE).success  # the intact one still loads


def test_a_plaintext_tier_s_value_is_no_sealed_box(tiers: list[InMemoryStoreTier]) -> None:
    """A value written before encryption was turned on (same store, same key) is a counted miss, never read as KV."""
    name = fresh_store()
    plain_memory, sealed_memory = Primary(2, CHUNK), Primary(2, CHUNK)
    plain = make_memory_tier(name, plain_memory)
    sealed = make_memory_tier(name, sealed_memory, encryption=encrypting())
    tiers += [plain, sealed]
    keys = chunk_keys(1, salt=6)
    plain_memory.fill([0], seed=6)
    assert run_job(plain, keys, [0], load=False).success
    if plain.object_key(keys[0]) != sealed.object_key(keys[0]):
        pytest.skip("the two tiers file the key under different names: nothing to read across")
    assert not run_job(sealed, keys, [1], load=True, tenant=ALICE).success
    assert sealed.integrity.total() == 1 and not sealed_memory.rows[1].any()


def test_a_job_whose_request_names_no_tenant_is_refused_without_touching_the_store(
    tiers: list[InMemoryStoreTier], caplog: pytest.LogCaptureFixture
) -> None:
    name = fresh_store()
    memory = Primary(2, CHUNK)
    tier = make_memory_tier(name, memory, encryption=encrypting())
    tiers.append(tier)
    memory.fill([0], seed=7)
    calls = dict(in_memory_store(name).calls)
    with caplog.at_level("WARNING"):
        assert not run_job(tier, chunk_keys(1, salt=7), [0], load=False).success
        assert not run_job(tier, chunk_keys(1, salt=7), [1], load=True).success
    assert in_memory_store(name).calls == calls
    assert tier.stats().failures["no_tenant"] == 2
    assert sum("names no tenant" in record.getMessage() for record in caplog.records) == 1  # warned once
    assert not stored_values(name)


def test_an_encrypting_tier_registers_none_of_the_primary_s_plaintext(tiers: list[InMemoryStoreTier]) -> None:
    name = fresh_store()
    tier = make_memory_tier(name, Primary(2, CHUNK), encryption=encrypting())
    tiers.append(tier)
    assert tier._slots.regions() == []  # pyright: ignore[reportPrivateUsage] -- what the store is handed


# --- through kvtriton's tiered spec and vLLM's orchestrator ----------------------------------------------------


KEY_VARIABLE = "KVTRITON_TEST_TIER_MASTER_KEY"


def encrypting_manager(
    managers: list[OffloadingManager], store: str, monkeypatch: pytest.MonkeyPatch, master: MasterKey = MASTER
) -> tuple[TieringOffloadingManager, InMemoryStoreTier, np.ndarray]:
    """kvtriton's tiered spec with ``kvtriton_encryption`` (the key in a variable) over one in-memory tier."""
    monkeypatch.setenv(KEY_VARIABLE, master.secret.hex())
    extra: dict[str, object] = {
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [
            {"type": "InMemoryStoreTier", "module_path": "kvtriton.integrations.remote", "store": store}
        ],
        "kvtriton_encryption": {"master_key_env": KEY_VARIABLE},
    }
    manager = tiering(managers, extra, worker_kv_bytes_per_block=CHUNK)
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, InMemoryStoreTier) and tier.wait_until_up(10.0)
    return manager, tier, np.asarray(manager.primary_tier.get_kv_memoryview())


def test_behind_the_tiered_spec_a_tenant_s_chunks_round_trip_sealed_once_and_other_tenants_miss(
    managers: list[OffloadingManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    name = fresh_store()
    writer, writer_tier, writer_rows = encrypting_manager(managers, name, monkeypatch)
    keys = chunk_keys(3, salt=8)
    written = serve_and_cascade(writer, writer_rows, keys, seed=8, tenant=ALICE)
    assert writer_tier.stats().stored_keys == 3
    # One pass: the orchestrator wrote no xxh3 seal into the slots (the box's tag is the check).
    primary = writer.primary_tier
    assert isinstance(primary, KVTritonPrimaryTier)
    slots = {bytes(key): slot for key, slot in primary.cpu.slot_map().items()}
    assert [writer_rows[slots[bytes(key)]].tobytes() for key in keys] == written
    for value in stored_values(name).values():
        assert not any(holds_plaintext_run(value, chunk) for chunk in written)

    reader, reader_tier, reader_rows = encrypting_manager(managers, name, monkeypatch)
    assert promote(reader, reader_rows, keys, tenant=ALICE) == written
    assert promote(reader, reader_rows, chunk_keys(3, salt=9), tenant=ALICE) is None  # never stored

    stranger, stranger_tier, stranger_rows = encrypting_manager(managers, name, monkeypatch)
    assert promote(stranger, stranger_rows, keys, tenant=RequestTenant("mallory")) is None
    assert stranger_tier.integrity.counts()["decrypt_tag_mismatch"] >= 1
    assert reader_tier.integrity.total() == 0
