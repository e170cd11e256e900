"""Parsing kvtriton's keys out of vLLM's kv_connector_extra_config (no vLLM needed)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvtriton.worker.backends import TransferBackend
from kvtriton.integrations.vllm_config import KVTritonOffloadConfig
from kvtriton.kernels import DEFAULT_NUM_PROGRAMS

GIB = 1 << 30


def test_only_cpu_bytes_to_use_is_required_and_the_rest_defaults_like_vllm() -> None:
    config = KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 64 * GIB})
    assert config == KVTritonOffloadConfig(
        cpu_bytes_to_use=64 * GIB,
        eviction_policy="lru",
        store_threshold=0,
        max_tracker_size=64_000,
        backend=TransferBackend.AUTO,
        num_programs=DEFAULT_NUM_PROGRAMS,
        pageable_slab=False,
    )
    assert not config.filters_reuse


def test_every_key_is_read() -> None:
    config = KVTritonOffloadConfig.from_extra_config(
        {
            "cpu_bytes_to_use": 1 << 20,
            "eviction_policy": "arc",
            "store_threshold": 3,
            "max_tracker_size": 100,
            "kvtriton_backend": "dma",
            "kvtriton_num_programs": 4,
            "kvtriton_pageable_slab": True,
            "spec_name": "KVTritonOffloadingSpec",  # the connector's own keys are left alone
            "block_size": 64,
        }
    )
    assert (config.eviction_policy, config.store_threshold, config.max_tracker_size) == ("arc", 3, 100)
    assert (config.backend, config.num_programs, config.pageable_slab) == (TransferBackend.DMA, 4, True)
    assert config.filters_reuse


def test_the_config_is_frozen() -> None:
    config = KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cpu_bytes_to_use = 2  # pyright: ignore[reportAttributeAccessIssue] -- the point of the test


def test_integral_strings_and_floats_from_a_shell_are_accepted() -> None:
    config = KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": "68719476736", "store_threshold": 2.0})
    assert (config.cpu_bytes_to_use, config.store_threshold) == (64 * GIB, 2)


@pytest.mark.parametrize(("raw", "expected"), [(True, True), (False, False), ("true", True), (" Yes ", True), ("0", False), ("off", False)])
def test_kvtriton_pageable_slab_reads_json_booleans_and_shell_words(raw: object, expected: bool) -> None:
    config = KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 1, "kvtriton_pageable_slab": raw})
    assert config.pageable_slab is expected


def test_names_are_case_insensitive() -> None:
    config = KVTritonOffloadConfig.from_extra_config(
        {"cpu_bytes_to_use": 1, "eviction_policy": "LRU", "kvtriton_backend": " Torch "}
    )
    assert (config.eviction_policy, config.backend) == ("lru", TransferBackend.TORCH)


def test_missing_cpu_bytes_to_use_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['cpu_bytes_to_use'\] is required"):
        KVTritonOffloadConfig.from_extra_config({"eviction_policy": "lru"})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("cpu_bytes_to_use", 0, r"'cpu_bytes_to_use'\] must be >= 1, got 0"),
        ("cpu_bytes_to_use", -5, r"'cpu_bytes_to_use'\] must be >= 1, got -5"),
        ("cpu_bytes_to_use", "64GiB", r"'cpu_bytes_to_use'\] must be an integer >= 1, got str '64GiB'"),
        ("cpu_bytes_to_use", 1.5, r"'cpu_bytes_to_use'\] must be an integer >= 1, got float 1.5"),
        ("cpu_bytes_to_use", True, r"'cpu_bytes_to_use'\] must be an integer >= 1, got bool True"),
        ("store_threshold", -1, r"'store_threshold'\] must be >= 0, got -1"),
        ("max_tracker_size", 0, r"'max_tracker_size'\] must be >= 1, got 0"),
        ("kvtriton_num_programs", 0, r"'kvtriton_num_programs'\] must be >= 1, got 0"),
        ("eviction_policy", "fifo", r"'eviction_policy'\] must be one of \['arc', 'lru'\], got 'fifo'"),
        ("eviction_policy", 3, r"'eviction_policy'\] must be a string, got int 3"),
        ("kvtriton_pageable_slab", "maybe", r"'kvtriton_pageable_slab'\] must be true or false, got str 'maybe'"),
        ("kvtriton_pageable_slab", 1, r"'kvtriton_pageable_slab'\] must be true or false, got int 1"),
        ("kvtriton_backend", "cuda", r"'kvtriton_backend'\] must be one of \['auto', 'triton', 'dma', 'torch'\], got 'cuda'"),
    ],
)
def test_an_invalid_value_raises_naming_the_key_and_the_value(key: str, value: object, message: str) -> None:
    extra: dict[str, object] = {"cpu_bytes_to_use": GIB, key: value}
    with pytest.raises(ValueError, match=message):
        KVTritonOffloadConfig.from_extra_config(extra)


def test_an_unknown_kvtriton_key_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtriton.integrations.vllm_config"):
        KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 1, "kvtriton_num_program": 8})
    assert "kvtriton_num_program" in caplog.text


def test_the_per_rank_share_splits_the_total_evenly() -> None:
    config = KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 64 * GIB})
    assert config.per_rank_bytes(4) == 16 * GIB
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        config.per_rank_bytes(0)
