"""The tiered spec's identity fingerprint: computed once, logged at start-up, shown on the primary's config info.

The fingerprint itself (what changes it, what must not) is tested in
test_vllm_identity.py; here, what the tiered spec does with it.
"""

from __future__ import annotations

import logging
from typing import cast

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from tiering_fixtures.configs import tiering_config
from tiering_fixtures.tiered_vllm import start_tiered_vllm
from vllm.config import ModelConfig
from vllm.v1.kv_offload.base import OffloadingManager
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import TIER_LABEL
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_fixtures.builders import TINY_MODEL_DIR

from kvtriton.integrations.vllm import KVTritonTieringOffloadingSpec
from kvtriton.integrations.vllm._sealed_tiering import IDENTITY_INFO_KEYS, SealedTieringManager

BUDGET: dict[str, object] = {"cpu_bytes_to_use": 1 << 20}
KEYED: dict[str, object] = {**BUDGET, "kvtriton_identity_key": "llama-prod-2026-11"}


def tiered_spec(extra: dict[str, object], **config: object) -> KVTritonTieringOffloadingSpec:
    spec = OffloadingSpecFactory.create_spec(tiering_config(extra, **config))  # pyright: ignore[reportArgumentType] -- keyword pass-through
    assert isinstance(spec, KVTritonTieringOffloadingSpec)
    return spec


def _identity_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if "offloading identity" in record.getMessage()]


def test_the_spec_computes_the_identity_and_its_manager_logs_it_in_one_start_up_line(
    caplog: pytest.LogCaptureFixture, managers: list[OffloadingManager]
) -> None:
    with caplog.at_level(logging.INFO, logger="kvtriton.integrations.vllm._tiered_spec"):
        spec = tiered_spec(BUDGET)
        identity = spec.identity
        assert identity.source == "computed" and identity.identity_key is None
        assert identity.parts.model == "tiny-tiering" and identity.parts.rank is None
        assert _identity_lines(caplog) == []  # a worker builds the spec too, and uses no identity
        managers.append(spec.get_manager())
        managers.append(spec.get_manager())  # vLLM asks once; a second call logs nothing more
    lines = _identity_lines(caplog)
    assert lines == [f"kvtriton tiered offloading {identity.describe()}"]
    assert lines[0].startswith(f"kvtriton tiered offloading identity {identity.hex} (computed): model='tiny-tiering'")


@pytest.fixture(scope="module")
def revised_model() -> ModelConfig:
    """The tiny Llama at a named revision (the slow part, once: vLLM inspects the model class)."""
    return ModelConfig(
        model=str(TINY_MODEL_DIR),
        revision="v1.2",
        skip_tokenizer_init=True,
        dtype="float16",
        seed=0,
        max_model_len=1024,
    )


def test_the_engine_core_and_every_worker_compute_one_complete_identity_and_it_is_logged_once(
    revised_model: ModelConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's own Scheduler builds the engine core's connector without a current vLLM config, each worker's
    connector is built under one: both read the model's dtype and revision from the config the connector is
    built from."""
    with caplog.at_level(logging.INFO, logger="kvtriton.integrations.vllm._tiered_spec"):
        engine = start_tiered_vllm(revised_model, dict(BUDGET), world_size=2)
    try:
        in_use = engine.tiering
        assert isinstance(in_use, SealedTieringManager)
        workers = [worker.connector_worker.spec for worker in engine.workers if worker.connector_worker]
        assert len(workers) == 2 and all(isinstance(spec, KVTritonTieringOffloadingSpec) for spec in workers)
        parts = in_use.identity.parts
        assert (parts.model_dtype, parts.revision, parts.model) == ("float16", "v1.2", str(TINY_MODEL_DIR))
        assert parts.weights  # the model's folder was found and read
        for spec in workers:
            assert cast("KVTritonTieringOffloadingSpec", spec).identity == in_use.identity
        assert _identity_lines(caplog) == [f"kvtriton tiered offloading {in_use.identity.describe()}"]
        assert "model_dtype=float16" in _identity_lines(caplog)[0] and "revision=v1.2" in _identity_lines(caplog)[0]
    finally:
        engine.shutdown()


def test_the_identity_key_replaces_the_model_part_so_two_model_paths_share_one_identity() -> None:
    first = tiered_spec(KEYED, model_name="/models/llama-a").identity
    second = tiered_spec(KEYED, model_name="/models/llama-b").identity
    assert first.source == "identity_key" and first.identity_key == "llama-prod-2026-11"
    assert first.fingerprint == second.fingerprint
    assert tiered_spec(BUDGET, model_name="/models/llama-a").identity.fingerprint != first.fingerprint


def test_what_changes_a_chunks_bytes_changes_the_identity_even_under_one_identity_key() -> None:
    base = tiered_spec(KEYED).identity.fingerprint
    assert tiered_spec(KEYED, blocks_per_chunk=2).identity.fingerprint != base
    assert tiered_spec(KEYED, worker_kv_bytes_per_block=4096).identity.fingerprint != base
    assert tiered_spec({**KEYED, "kvtriton_kv_compression": "fp8-e4m3"}).identity.fingerprint != base


def test_an_empty_identity_key_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['kvtriton_identity_key'\] must be a non-empty"):
        tiered_spec({**BUDGET, "kvtriton_identity_key": "  "})


def test_the_primary_tiers_config_info_shows_the_identity_and_its_source(
    managers: list[OffloadingManager],
) -> None:
    assert set(IDENTITY_INFO_KEYS) <= set(KVTritonTieringOffloadingSpec.config_info_keys(dict(KEYED)))
    spec = tiered_spec(KEYED)
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    managers.append(manager)
    (primary,) = manager.config_info()
    assert primary[TIER_LABEL] == "0:primary"
    assert primary["kvtriton_identity"] == spec.identity.hex
    assert primary["kvtriton_identity_source"] == "identity_key"
    assert primary["cpu_num_chunks"] == spec.num_chunks  # vLLM's own labels stay
