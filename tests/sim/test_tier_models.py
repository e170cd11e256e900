"""The tier registry: every ``--tier`` name builds a store of its own kind, and a new backend is one entry there.

A backend registered here (a pool the simulator calls ``ram``, a store model
of its own) is parsed, sized, replayed, priced and configured for vLLM
without another edit, and docs/simulate.md lists what the registry holds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtriton._integrity import SEAL_BYTES
from kvtriton.sim._geometry import GIB, KVDtype, ModelGeometry
from kvtriton.sim._planner import VllmOrder
from kvtriton.sim._replay import prepare
from kvtriton.sim._secondary_tier import FsTier, MooncakePool, SecondaryTier
from kvtriton.sim._tier_models import (
    TIER_MODELS,
    TierModel,
    TierSpec,
    parse_tier,
    tier_choices,
    tier_extra_config,
    tier_help,
    tier_metavar,
    tier_names,
)
from kvtriton.sim._tiered_planner import recommend_tiered, replay_tiered
from kvtriton.sim._workloads import Request

DOCS = Path(__file__).resolve().parents[2] / "docs" / "simulate.md"
BLOCK = 16
GEOMETRY = ModelGeometry("tiny", num_layers=2, num_kv_heads=1, head_dim=16, dtype=KVDtype.BFLOAT16, block_size=BLOCK)


class RamPool(MooncakePool):
    """A pool of a backend the simulator did not know: Mooncake's eviction, a name of its own."""

    kind = "ram"


def _ram_pool(objects: int | None) -> SecondaryTier:
    if objects is None:
        raise ValueError("a ram pool needs a size")
    return RamPool(objects)


RAM = TierModel(
    name="ram",
    help="a shared DRAM pool of SIZE",
    heading="a shared DRAM pool",
    store=_ram_pool,
    vllm_config={"type": "RamTier", "module_path": "example.ram", "address": "<host:port>"},
    bought_as="a DRAM pool of {size}",
    deployment="pool:      {size} of DRAM",
    sized=True,
    object_overhead_bytes=128,
)


def test_every_registered_tier_builds_an_empty_store_of_its_own_kind() -> None:
    assert tier_names() == ["fs", "mooncake"]  # the e2e fidelity tests run `simulate --tier fs|mooncake`
    for name, model in TIER_MODELS.items():
        spec = TierSpec(name, 64 * GIB if model.sized else None)
        store = spec.build(GEOMETRY)
        assert (model.name, store.kind, store.chunks) == (name, name, 0)
        assert spec.object_bytes(GEOMETRY) == GEOMETRY.tiered_chunk_bytes + model.object_overhead_bytes
    assert isinstance(TierSpec("fs").build(GEOMETRY), FsTier)
    assert TIER_MODELS["mooncake"].object_overhead_bytes == SEAL_BYTES  # the value carries a seal of its own


def test_a_tier_spec_names_a_registered_tier_and_a_sized_one_needs_its_size_to_build() -> None:
    with pytest.raises(ValueError, match=r"kind must be one of \['fs', 'mooncake'\], got 'nfs'"):
        TierSpec("nfs")
    assert TierSpec("mooncake").describe() == "mooncake"  # a size still to sweep (it used to read "fs")
    with pytest.raises(ValueError, match="needs a size"):
        TierSpec("mooncake").build(GEOMETRY)


def test_the_commands_words_for_tier_come_from_the_registry() -> None:
    assert tier_metavar() == "fs|mooncake[:SIZE]"
    assert tier_choices() == "fs or mooncake"
    for model in TIER_MODELS.values():
        assert model.help in tier_help()


def test_a_new_backend_is_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TIER_MODELS, "ram", RAM)
    assert parse_tier(" RAM:1GiB ") == TierSpec("ram", GIB)
    assert parse_tier("ram") == TierSpec("ram")  # its size swept
    assert tier_metavar() == "fs|mooncake[:SIZE]|ram[:SIZE]"
    assert "'ram:SIZE' (a shared DRAM pool of SIZE), or 'ram' to sweep its size" in tier_help()
    with pytest.raises(ValueError, match="tier must be fs, mooncake, mooncake:SIZE, ram or ram:SIZE"):
        parse_tier("s3")
    with pytest.raises(ValueError, match=r"a DRAM pool of 100 B holds no chunk of \d"):
        TierSpec("ram", 100).build(GEOMETRY)

    # Replayed, sized and configured as its entry says: the prompt's two chunks cascade into the pool.
    prompts = [Request("r1", (b"a" * 16, b"b" * 16), 2 * BLOCK + 8)]
    pool = TierSpec("ram", 10 * (GEOMETRY.tiered_chunk_bytes + 128))
    order = VllmOrder(sequential=True, store_steps=1)
    report = replay_tiered([prepare(prompts)], GEOMETRY, 4 * GEOMETRY.tiered_chunk_bytes, pool, "lru", order).report
    assert report.counts is not None and report.counts.kind == "ram"
    assert (report.counts.cascaded_chunks, report.counts.tier_chunks) == (2, 2)
    assert report.tier_object_bytes == GEOMETRY.tiered_chunk_bytes + 128
    assert report.tier_size_bytes == pool.capacity_bytes
    assert tier_extra_config(pool) == dict(RAM.vllm_config)
    found = recommend_tiered([report], 0.0, 10.0, GEOMETRY)
    assert found.extra_config is not None and found.extra_config["secondary_tiers"] == [dict(RAM.vllm_config)]


def test_docs_simulate_md_lists_every_registered_tier() -> None:
    section = DOCS.read_text(encoding="utf-8").split("### Tier models", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^\| `([a-z][a-z0-9_.-]*)` \|", section, flags=re.MULTILINE)
    assert listed == tier_names()
