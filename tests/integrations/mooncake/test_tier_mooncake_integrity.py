"""MooncakeStoreTier fails closed: a value that is not this key's sealed chunk of this identity is a counted miss.

A real mooncake_master and storage holder on 127.0.0.1 (tests/mooncake_fixtures).
A writer tier stores sealed chunks; the test then plants, under a key, what a
broken or foreign writer would leave there (other bytes of the right size,
another identity's value, a truncated or over-long one, another key's, one of
an older row format) and loads it through the tier's own calls. Each is a
miss for that key only, counted by reason in
``vllm:kv_offload_integrity_failures``, with a WARNING, and the tier stays up
and keeps serving the good keys.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from mooncake_fixtures import MOONCAKE_MISSING, MooncakeCluster

if MOONCAKE_MISSING is not None:
    pytest.skip(MOONCAKE_MISSING, allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import dataclasses

import numpy as np
import xxhash
from mooncake_fixtures.tiers import Primary, chunk_keys, resolve_lookups, run_job
from vllm.v1.kv_offload.base import LookupResult, OffloadKey
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm_fixtures.builders import TINY_MODEL_DIR, offloading_config

from kvtriton._integrity import ROW_FORMAT_VERSION, SEAL_BYTES, IntegrityFault, key_digest
from kvtriton.integrations.mooncake import MooncakeStoreTier, StoreClient, TierState
from kvtriton.integrations.vllm._integrity_report import INTEGRITY_FAILURES

if TYPE_CHECKING:
    from tests.integrations.mooncake.conftest import NewTier

CHUNK = 64 * 1024
SEALED = CHUNK + SEAL_BYTES
HIT, MISS = LookupResult.HIT, LookupResult.MISS
LABEL = "MooncakeStoreTier"
"""The tier label of a tier built outside vLLM's factory (vLLM's adds the position: ``1:MooncakeStoreTier``)."""


def _plant(store: StoreClient, object_key: str, value: bytes) -> None:
    """Leave ``value`` under ``object_key``, replacing what is there (a put keeps an existing object)."""
    store.batch_remove([object_key], force=True)
    assert store.put(object_key, value) == 0


def _integrity_metrics(tier: MooncakeStoreTier) -> dict[str, float]:
    reduced = tier.get_stats().reduce()
    prefix = f"{INTEGRITY_FAILURES}:"
    found: dict[str, float] = {}
    for fault in IntegrityFault:
        value = reduced.get(f"{prefix}{(LABEL, fault.value)}")
        if value:
            found[fault.value] = value
    return found


def _stale_value(chunk: bytes, key: OffloadKey, fingerprint: bytes) -> bytes:
    """The value an older kvtriton (row format ROW_FORMAT_VERSION - 1) would have stored, with its own valid checksum."""
    checked = struct.pack("<16s16sQI4s", fingerprint, key_digest(key), len(chunk), ROW_FORMAT_VERSION - 1, b"KVTs")
    state = xxhash.xxh3_128(chunk)
    state.update(checked)
    return chunk + state.digest() + checked


def test_a_stored_value_is_the_chunk_followed_by_its_seal(new_tier: NewTier, store: StoreClient) -> None:
    memory = Primary(2, CHUNK)
    tier = new_tier(memory, "sealed")
    (key,) = chunk_keys(1, salt=40)
    (written,) = memory.fill([0], seed=40)
    assert run_job(tier, [key], [0], load=False).success
    value = store.get(tier.object_key(key))
    assert len(value) == SEALED and value[:CHUNK] == written
    assert tier.identity.hex in json.loads(store.get(tier.keyspace.manifest_key))["fingerprint"]
    assert tier.config_info()["mooncake_identity"] == tier.identity.hex


@pytest.mark.parametrize(
    "fault",
    [
        IntegrityFault.CHECKSUM,
        IntegrityFault.TORN,
        IntegrityFault.WRONG_SIZE,
        IntegrityFault.OTHER_KEY,
        IntegrityFault.STALE_FORMAT,
        IntegrityFault.OTHER_FINGERPRINT,
    ],
    ids=lambda fault: fault.value,
)
def test_each_planted_value_is_a_counted_miss_and_the_tier_serves_on(
    new_tier: NewTier,
    store: StoreClient,
    fault: IntegrityFault,
    caplog: pytest.LogCaptureFixture,
) -> None:
    memory = Primary(8, CHUNK)
    tier = new_tier(memory, f"planted-{fault.value}")
    salt = 50 + list(IntegrityFault).index(fault)
    good, victim, donor = chunk_keys(3, salt=salt)
    written = memory.fill([0, 1, 2], seed=salt)
    assert run_job(tier, [good, victim, donor], [0, 1, 2], load=False).success
    victim_key = tier.object_key(victim)
    sealed = store.get(victim_key)
    assert len(sealed) == SEALED

    if fault is IntegrityFault.CHECKSUM:  # 64 bytes flipped in the middle, the seal left as it was
        damaged = bytearray(sealed)
        damaged[CHUNK // 2 : CHUNK // 2 + 64] = bytes(byte ^ 0xFF for byte in damaged[CHUNK // 2 : CHUNK // 2 + 64])
        planted = bytes(damaged)
    elif fault is IntegrityFault.TORN:
        planted = sealed[: SEALED // 2]
    elif fault is IntegrityFault.WRONG_SIZE:
        planted = sealed + b"\x00" * 4096
    elif fault is IntegrityFault.OTHER_KEY:
        planted = store.get(tier.object_key(donor))
    elif fault is IntegrityFault.STALE_FORMAT:
        planted = _stale_value(written[1], victim, tier.identity.fingerprint)
    else:  # another identity's intact value: the same chunk sealed by an engine with a bf16 KV cache
        other_memory = Primary(2, CHUNK)
        other = new_tier(other_memory, f"planted-{fault.value}", dtype_override="bfloat16")
        assert other.identity.fingerprint != tier.identity.fingerprint
        other_memory.rows[0] = np.frombuffer(written[1], dtype=np.uint8)
        assert run_job(other, [victim], [0], load=False).success
        planted = store.get(other.object_key(victim))
    _plant(store, victim_key, planted)

    assert resolve_lookups(tier, [good, victim]) == [HIT, HIT]  # the value exists ...
    with caplog.at_level(logging.WARNING, logger="kvtriton"):
        result = run_job(tier, [good, victim], [4, 5], load=True)
    assert not result.success  # ... but it is no hit
    assert result.successful_keys is not None and list(result.successful_keys) == [good]
    assert memory.chunk(4) == written[0]
    assert _integrity_metrics(tier) == {fault.value: 1}
    assert _integrity_metrics(tier) == {}  # reported once, as an increment
    stats = tier.stats()
    assert (stats.integrity_failures, stats.load_failed_keys, stats.loaded_keys) == (1, 1, 1)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any(f"tier {LABEL}" in message and f"reason {fault.value}" in message for message in warnings), warnings

    # The tier is alive: the good key loads again, and a fresh store of the victim replaces nothing it should not.
    assert tier.state is TierState.UP
    again = run_job(tier, [good], [6], load=True)
    assert again.success and memory.chunk(6) == written[0]


def test_a_value_of_the_right_size_with_other_bytes_is_a_miss(new_tier: NewTier, store: StoreClient) -> None:
    memory = Primary(4, CHUNK)
    tier = new_tier(memory, "right-size")
    (key,) = chunk_keys(1, salt=60)
    _plant(store, tier.object_key(key), np.random.default_rng(60).integers(0, 256, SEALED, dtype=np.uint8).tobytes())
    result = run_job(tier, [key], [1], load=True)
    assert (result.success, result.successful_keys) == (False, None)
    assert _integrity_metrics(tier) == {IntegrityFault.TORN.value: 1}  # no seal at its end
    assert tier.state is TierState.UP


def test_the_keys_are_filed_under_the_identity_so_changed_weights_see_only_misses(
    cluster: MooncakeCluster, tiers: list[MooncakeStoreTier], tmp_path: Path
) -> None:
    """A model re-deployed at the same path with other weights, the same namespace: no old chunk is ever loaded."""
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL_DIR, model)
    (model / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}" + bytes(4096))

    def tier_of(memory: Primary) -> MooncakeStoreTier:
        config = offloading_config({"cpu_bytes_to_use": memory.rows.nbytes})
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, name=str(model)))
        tier = MooncakeStoreTier(
            CPUOffloadingSpec(config),
            memory.view,
            "MooncakeStoreTier",
            master_server_address=cluster.master_address,
            namespace="redeployed",
        )
        tiers.append(tier)
        assert tier.wait_until_up(10.0)
        return tier

    old_memory = Primary(2, CHUNK)
    old = tier_of(old_memory)
    keys = chunk_keys(2, salt=70)
    old_memory.fill([0, 1], seed=70)
    assert run_job(old, keys, [0, 1], load=False).success

    (model / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}" + b"\x01" * 4096)  # a fine-tune copied over
    new = tier_of(Primary(2, CHUNK))
    assert new.identity.parts.weights != old.identity.parts.weights
    assert new.keyspace.digest != old.keyspace.digest
    assert resolve_lookups(new, keys) == [MISS, MISS]
    assert resolve_lookups(old, keys) == [HIT, HIT]
