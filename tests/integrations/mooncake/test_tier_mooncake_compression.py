"""The Mooncake tier behind kvtriton's tiered spec with compressed rows: the digest names the compression.

A compressed engine's chunks are fp8 codes and scales, an uncompressed
engine's are the KV bytes; the two have chunks of the same size here (rows
pad to a page), so only the namespace digest keeps them apart. An engine of
the same compression promotes the chunks bit-exact; one without misses.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from mooncake_fixtures import MOONCAKE_MISSING

if MOONCAKE_MISSING is not None:
    pytest.skip(MOONCAKE_MISSING, allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import numpy as np
from mooncake_fixtures.managers import promote, serve_and_cascade, started
from mooncake_fixtures.tiers import chunk_keys
from tiering_fixtures.configs import tiering_config
from vllm.v1.kv_offload.base import OffloadingManager
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvtriton.integrations.mooncake import MooncakeStoreTier, StoreClient
from kvtriton.integrations.vllm._tiered_spec import LAYOUT_TAG

TAG = f"{LAYOUT_TAG}+fp8-e4m3-g128"


TierEntry = Callable[[str], dict[str, object]]
"""The type of the folder's ``tier_entry`` fixture (tests/integrations/mooncake/conftest.py)."""


def kvtriton_manager(
    tier_entry: TierEntry, made: list[OffloadingManager], *, compressed: bool
) -> tuple[TieringOffloadingManager, MooncakeStoreTier, np.ndarray]:
    extra: dict[str, object] = {"cpu_bytes_to_use": 8 * 4096, "secondary_tiers": [tier_entry("compression")]}
    if compressed:
        extra["kvtriton_kv_compression"] = "fp8-e4m3"
    return started(
        OffloadingSpecFactory.create_spec(tiering_config(extra, worker_kv_bytes_per_block=2048)).get_manager(), made
    )


def test_compressed_chunks_are_promoted_by_a_compressed_engine_and_missed_by_an_uncompressed_one(
    tier_entry: TierEntry, managers: list[OffloadingManager]
) -> None:
    writer, writer_tier, writer_rows = kvtriton_manager(tier_entry, managers, compressed=True)
    assert writer_tier.keyspace.identity.layout_tag == TAG
    assert writer_tier.keyspace.identity.chunk_bytes == 4096
    keys = chunk_keys(3, salt=77)
    written = serve_and_cascade(writer, writer_rows, keys, seed=77)
    assert writer_tier.stats().stored_keys == 3

    plain, plain_tier, plain_rows = kvtriton_manager(tier_entry, managers, compressed=False)
    assert plain_tier.keyspace.identity.chunk_bytes == 4096  # same size: only the digest tells them apart
    assert plain_tier.keyspace.digest != writer_tier.keyspace.digest
    assert promote(plain, plain_rows, keys) is None
    assert plain_tier.stats().loaded_keys == 0

    reader, reader_tier, reader_rows = kvtriton_manager(tier_entry, managers, compressed=True)
    assert reader_tier.keyspace.digest == writer_tier.keyspace.digest
    assert promote(reader, reader_rows, keys) == written
    assert reader_tier.stats().loaded_keys == 3


def test_the_manifest_behind_a_compressed_digest_names_the_compression_and_its_group_size(
    tier_entry: TierEntry, managers: list[OffloadingManager], store: StoreClient
) -> None:
    _, tier, _ = kvtriton_manager(tier_entry, managers, compressed=True)
    manifest = json.loads(store.get(tier.keyspace.manifest_key))
    assert manifest["layout_tag"] == TAG
    assert str(manifest["model"]).startswith(f"tiny-tiering@{TAG}@id-")
