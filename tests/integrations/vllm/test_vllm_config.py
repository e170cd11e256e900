"""Parsing kvtriton's keys out of vLLM's kv_connector_extra_config (no vLLM needed)."""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from pathlib import Path

import pytest
import torch

from kvtriton.integrations.vllm._config import (
    TIERED_ONLY_KEYS,
    VLLM_KEYS,
    KVTritonOffloadConfig,
    check_budget,
    check_keys,
    check_vllm_policy,
    compressed_row_bytes,
    compression_tag,
    host_ram_bytes,
    host_row_bytes,
    kv_dtype,
    parse_policy,
)
from kvtriton.kernels import DEFAULT_NUM_PROGRAMS
from kvtriton.kernels._compressed_format import compression_layout
from kvtriton.kernels._compression import KVCompression
from kvtriton.manager import policy_names
from kvtriton.worker._backends import TransferBackend

GIB = 1 << 30
NO_CLOSE_KEY = "no known key is close"
VALID_KEYS = (
    "kvtriton reads ['kvtriton_backend', 'kvtriton_encryption', 'kvtriton_identity_key', 'kvtriton_kv_compression', 'kvtriton_num_programs', "
    "'kvtriton_pageable_slab', 'kvtriton_shared_group', 'kvtriton_summary_interval_s', 'kvtriton_verify_host_loads'], "
    f"vLLM reads {sorted(VLLM_KEYS)}"
)


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
        kv_compression=KVCompression.NONE,
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


@pytest.mark.parametrize(
    ("raw", "expected"), [(True, True), (False, False), ("true", True), (" Yes ", True), ("0", False), ("off", False)]
)
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
        ("cpu_bytes_to_use", 0, r"'cpu_bytes_to_use'\] must be >= 1 bytes, got 0"),
        ("cpu_bytes_to_use", -5, r"'cpu_bytes_to_use'\] must be >= 1 bytes, got -5"),
        ("cpu_bytes_to_use", "64GiB", r"'cpu_bytes_to_use'\] must be an integer >= 1 bytes, got str '64GiB'"),
        ("cpu_bytes_to_use", float("inf"), r"'cpu_bytes_to_use'\] must be an integer >= 1 bytes, got float inf"),
        ("cpu_bytes_to_use", True, r"'cpu_bytes_to_use'\] must be an integer >= 1 bytes, got bool True"),
        ("store_threshold", 1.5, r"'store_threshold'\] must be an integer >= 0, got float 1.5"),
        ("store_threshold", -1, r"'store_threshold'\] must be >= 0, got -1"),
        ("max_tracker_size", 0, r"'max_tracker_size'\] must be >= 1, got 0"),
        ("kvtriton_num_programs", 0, r"'kvtriton_num_programs'\] must be >= 1, got 0"),
        ("eviction_policy", 3, r"'eviction_policy'\] must be a string, got int 3"),
        ("eviction_policy", " ", r"'eviction_policy'\] must name a policy, got ' '"),
        ("cache_policy_module_path", 7, r"'cache_policy_module_path'\] must be a Python module path, got int 7"),
        ("kvtriton_pageable_slab", "maybe", r"'kvtriton_pageable_slab'\] must be true or false, got str 'maybe'"),
        ("kvtriton_pageable_slab", 1, r"'kvtriton_pageable_slab'\] must be true or false, got int 1"),
        (
            "kvtriton_backend",
            "cuda",
            r"'kvtriton_backend'\] must be one of \['auto', 'triton', 'dma', 'torch'\], got 'cuda'",
        ),
    ],
)
def test_an_invalid_value_raises_naming_the_key_and_the_value(key: str, value: object, message: str) -> None:
    extra: dict[str, object] = {"cpu_bytes_to_use": GIB, key: value}
    with pytest.raises(ValueError, match=message):
        KVTritonOffloadConfig.from_extra_config(extra)


def test_a_fractional_byte_size_rounds_down_as_vllms_spec_does() -> None:
    # vLLM's own --kv-offloading-size 2.3 arrives as 2.3 * 2**30.
    config = KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 2.3 * GIB})
    assert config.cpu_bytes_to_use == int(2.3 * GIB)


def test_names_are_case_insensitive_at_every_kvtriton_key() -> None:
    config = KVTritonOffloadConfig.from_extra_config(
        {"cpu_bytes_to_use": 1, "eviction_policy": "ARC", "kvtriton_backend": "TRITON"}
        | {"kvtriton_kv_compression": "FP8-E4M3"}
    )
    parsed = (config.eviction_policy, config.backend, config.kv_compression)
    assert parsed == ("arc", TransferBackend.TRITON, KVCompression.FP8_E4M3)


def test_a_policy_named_with_a_module_path_keeps_its_case_it_names_a_class() -> None:
    assert parse_policy({"eviction_policy": "ARC", "cache_policy_module_path": "my.policies"}) == ("ARC", "my.policies")
    assert parse_policy({"eviction_policy": "ARC"}) == ("arc", None)


def test_vllms_policy_check_names_the_class_vllm_loads() -> None:
    pytest.importorskip("vllm")
    assert check_vllm_policy("lru", None) == "vllm.v1.kv_offload.cpu.policies.lru.LRUCachePolicy"
    assert (
        check_vllm_policy("ARCCachePolicy", "vllm.v1.kv_offload.cpu.policies.arc")
        == "vllm.v1.kv_offload.cpu.policies.arc.ARCCachePolicy"
    )


def test_a_policy_kvtriton_does_not_implement_is_left_to_vllm() -> None:
    ours = KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 1, "eviction_policy": " ARC "})
    assert (ours.eviction_policy, ours.uses_vllm_policy) == ("arc", False)
    module = "vllm.v1.kv_offload.cpu.policies.lru"
    theirs = KVTritonOffloadConfig.from_extra_config(
        {"cpu_bytes_to_use": 1, "eviction_policy": "LRUCachePolicy", "cache_policy_module_path": f" {module} "}
    )
    assert (theirs.eviction_policy, theirs.cache_policy_module_path, theirs.uses_vllm_policy) == (
        "LRUCachePolicy",
        module,
        True,
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"eviction_policy": "nosuch"}, rf"\['eviction_policy'\] must be one of {re.escape(str(policy_names()))}, got 'nosuch': "
         r"neither kvtriton's policies nor vLLM's CachePolicyFactory \(registered: \['arc', 'lru'\]\) resolve it"),
        ({"eviction_policy": "Fifo", "cache_policy_module_path": "no_such.policies"},
         r"\['cache_policy_module_path'\]='no_such.policies' cannot be imported "
         r"\(ModuleNotFoundError: No module named 'no_such'\)"),
        # vLLM's registered ARC would run and the module would never be imported.
        ({"eviction_policy": "arc", "cache_policy_module_path": "my_policies_typo"},
         r"\['cache_policy_module_path'\]='my_policies_typo' cannot be imported \(ModuleNotFoundError"),
        ({"cache_policy_module_path": "arc"}, r"\['cache_policy_module_path'\]='arc' cannot be imported"),
        ({"eviction_policy": "ARC", "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.arc"},
         r"\['eviction_policy'\]='ARC' is not a vLLM CachePolicy class of module "
         r"'vllm.v1.kv_offload.cpu.policies.arc'"),
        ({"eviction_policy": "arc", "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.arc"},
         r"\['eviction_policy'\]='arc' is a policy vLLM's CachePolicyFactory has registered, which vLLM loads without "
         r"ever reading kv_connector_extra_config\['cache_policy_module_path'\]='vllm.v1.kv_offload.cpu.policies.arc'"),
        ({"eviction_policy": "LRUPolicy", "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.lru"},
         r"\['eviction_policy'\]='LRUPolicy' is not a vLLM CachePolicy class of module "
         r"'vllm.v1.kv_offload.cpu.policies.lru' .*the CachePolicy classes it defines: \['LRUCachePolicy'\]"),
    ],
)  # fmt: skip  # a table: one bad policy setting a case, its message beneath
def test_a_policy_neither_kvtriton_nor_vllm_resolves_is_refused_naming_the_keys(
    extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 1, **extra})


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("kvtriton_num_program", "did you mean 'kvtriton_num_programs'?"),
        ("eviction_polcy", "did you mean 'eviction_policy'?"),
        ("cpu_bytes", "did you mean 'cpu_bytes_to_use'?"),
        (
            "cache_policy",
            "did you mean 'eviction_policy'? 'cache_policy' is the manager's argument; the configuration key is "
            "'eviction_policy'",
        ),
        ("backend", "did you mean 'kvtriton_backend'?"),
        ("kv_compression", "did you mean 'kvtriton_kv_compression'?"),
        ("connectors", NO_CLOSE_KEY),  # MultiConnector's key, never in a child connector's extra config
        ("completely_else", NO_CLOSE_KEY),
    ],
)
def test_an_unknown_key_is_refused_naming_it_and_the_closest_valid_key(key: str, expected: str) -> None:
    extra: dict[str, object] = {"cpu_bytes_to_use": 1, "spec_name": "KVTritonOffloadingSpec", key: 8}
    for tiered in (False, True):
        with pytest.raises(ValueError) as raised:
            check_keys(extra, tiered=tiered)
        # The valid keys are in the message: a wheel install has no docs/ to send the user to.
        assert str(raised.value) == (
            f"kv_connector_extra_config has a key neither kvtriton nor vLLM reads: {key!r} ({expected}); {VALID_KEYS}"
        )


def test_every_unknown_key_is_named_in_one_error() -> None:
    message = r"has keys neither kvtriton nor vLLM reads: 'eviction_polcy' \(did you mean 'eviction_policy'\?\); 'cpu_"
    with pytest.raises(ValueError, match=message):
        check_keys({"eviction_polcy": "arc", "cpu_bytes": 1}, tiered=False)


def test_tiered_keys_in_the_single_tier_spec_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    extra: dict[str, object] = {"cpu_bytes_to_use": 1, "secondary_tiers": [], "tier_poll_interval_s": 0.1}
    with caplog.at_level(logging.WARNING, logger="kvtriton.integrations.vllm._config"):
        assert check_keys(extra, tiered=False) == ["secondary_tiers", "tier_poll_interval_s"]
        assert check_keys(extra, tiered=True) == []
    assert "ignoring kv_connector_extra_config['secondary_tiers']: only the tiered spec" in caplog.text


def test_the_identity_key_is_accepted_but_ignored_with_a_warning_by_the_single_tier_spec(
    caplog: pytest.LogCaptureFixture,
) -> None:
    extra: dict[str, object] = {"cpu_bytes_to_use": 1, "kvtriton_identity_key": "llama-prod-2026-11"}
    with caplog.at_level(logging.WARNING, logger="kvtriton.integrations.vllm._config"):
        assert check_keys(extra, tiered=True) == []
        assert caplog.text == ""
        assert check_keys(extra, tiered=False) == ["kvtriton_identity_key"]
    assert "ignoring kv_connector_extra_config['kvtriton_identity_key']: only the tiered spec" in caplog.text


def test_verify_host_loads_is_read_by_the_single_tier_spec_and_ignored_with_a_warning_by_the_tiered_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    extra: dict[str, object] = {"cpu_bytes_to_use": 1, "kvtriton_verify_host_loads": "yes"}
    assert KVTritonOffloadConfig.from_extra_config(extra).verify_host_loads
    assert not KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 1}).verify_host_loads
    with pytest.raises(
        ValueError, match=r"\['kvtriton_verify_host_loads'\] must be true or false, got str 'sometimes'"
    ):
        KVTritonOffloadConfig.from_extra_config({**extra, "kvtriton_verify_host_loads": "sometimes"})
    with caplog.at_level(logging.WARNING, logger="kvtriton.integrations.vllm._config"):
        assert check_keys(extra, tiered=False) == []
        assert caplog.text == ""
        assert check_keys(extra, tiered=True) == ["kvtriton_verify_host_loads"]
    assert "ignoring kv_connector_extra_config['kvtriton_verify_host_loads']: only the single-tier spec" in caplog.text


def test_every_key_vllm_or_kvtriton_reads_passes_silently(caplog: pytest.LogCaptureFixture) -> None:
    extra: dict[str, object] = {key: 1 for key in VLLM_KEYS if key not in TIERED_ONLY_KEYS}
    extra.update({"kvtriton_backend": "torch", "kvtriton_num_programs": 4, "kvtriton_pageable_slab": True})
    extra.update({"kvtriton_kv_compression": "none", "kvtriton_summary_interval_s": 0})
    with caplog.at_level(logging.WARNING, logger="kvtriton.integrations.vllm._config"):
        assert check_keys(extra, tiered=False) == []
        assert check_keys({**extra, **{key: 1 for key in TIERED_ONLY_KEYS}}, tiered=True) == []
    assert caplog.text == ""


def test_every_key_vllms_offloading_code_reads_from_the_extra_config_is_accepted() -> None:
    """Read from the installed vLLM's connector and kv_offload sources, so a vLLM upgrade that adds a key fails here."""
    vllm = pytest.importorskip("vllm")
    root = Path(vllm.__file__).parent
    sources = [root / "distributed/kv_transfer/kv_connector/v1/offloading_connector.py"]
    sources += sorted((root / "distributed/kv_transfer/kv_connector/v1/offloading").rglob("*.py"))
    sources += sorted((root / "v1/kv_offload").rglob("*.py"))
    read = {
        key
        for source in sources
        for key in re.findall(r'extra_config(?:\.get\(|\[)\s*"([a-z_]+)"', source.read_text(encoding="utf-8"))
    }
    assert {"cpu_bytes_to_use", "cache_policy_module_path", "sync_load_budget_bytes", "secondary_tiers"} <= read
    assert read <= VLLM_KEYS
    assert check_keys(dict.fromkeys(read, 1), tiered=True) == []


def test_a_budget_below_one_slot_says_the_unit_is_bytes() -> None:
    below_one_slot = (
        r"kv_connector_extra_config\['cpu_bytes_to_use'\]=64: 64 bytes is less than one slot of 4096 bytes; "
        r"the value is in bytes \(vLLM's --kv-offloading-size is in GiB"
    )
    with pytest.raises(ValueError, match=below_one_slot):
        check_budget(64, slot_bytes=4096, world_size=1)
    with pytest.raises(
        ValueError, match=r"8192 bytes \(4096 bytes per rank over world_size=2\) is less than one chunk"
    ):
        check_budget(8192, slot_bytes=8192, world_size=2, slot="chunk")


def test_a_budget_beyond_host_ram_is_refused_when_the_spec_is_built() -> None:
    ram = host_ram_bytes()
    assert ram is not None and ram > 0
    with pytest.raises(ValueError, match=r"=1e\+30|exceed this host's \d+ bytes of RAM"):
        check_budget(int(1e30), slot_bytes=4096, world_size=1)
    check_budget(ram // 2, slot_bytes=4096, world_size=1)


def test_a_total_beyond_host_ram_over_several_ranks_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    ram = host_ram_bytes()
    assert ram is not None
    with caplog.at_level(logging.WARNING, logger="kvtriton.integrations.vllm._config"):
        check_budget(ram * 3 // 2, slot_bytes=4096, world_size=4)
    assert "only fits if the 4 ranks are spread over several hosts" in caplog.text


def test_the_per_rank_share_splits_the_total_evenly() -> None:
    config = KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 64 * GIB})
    assert config.per_rank_bytes(4) == 16 * GIB
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        config.per_rank_bytes(0)


@pytest.mark.parametrize("value", ["fp8-e4m3", "FP8-E4M3", " fp8-e4m3 "])
def test_kv_compression_is_read_in_any_case(value: str) -> None:
    config = KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 1, "kvtriton_kv_compression": value})
    assert config.kv_compression is KVCompression.FP8_E4M3
    assert (
        KVTritonOffloadConfig.from_extra_config(
            {"cpu_bytes_to_use": 1, "kvtriton_kv_compression": "none"}
        ).kv_compression
        is KVCompression.NONE
    )


@pytest.mark.parametrize("value", ["fp8", "int4", 8, True, ""])
def test_a_bad_kv_compression_is_refused_naming_the_key_the_value_and_the_choices(value: object) -> None:
    with pytest.raises(ValueError, match=r"\['kvtriton_kv_compression'\]") as raised:
        KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 1, "kvtriton_kv_compression": value})
    assert repr(value) in str(raised.value)
    if isinstance(value, str):
        assert "['none', 'fp8-e4m3']" in str(raised.value)


def test_compression_with_the_dma_backend_is_refused_naming_both_keys() -> None:
    with pytest.raises(ValueError, match=r"\['kvtriton_kv_compression'\]='fp8-e4m3'.*\['kvtriton_backend'\]='dma'"):
        KVTritonOffloadConfig.from_extra_config(
            {"cpu_bytes_to_use": 1, "kvtriton_kv_compression": "fp8-e4m3", "kvtriton_backend": "dma"}
        )


def test_the_compression_tag_names_the_format_and_the_group_size() -> None:
    assert compression_tag(KVCompression.NONE) is None
    assert compression_tag(KVCompression.FP8_E4M3) == "fp8-e4m3-g128"


def test_compression_needs_a_kv_cache_of_a_dtype_it_compresses() -> None:
    assert kv_dtype("bfloat16", KVCompression.FP8_E4M3) is torch.bfloat16
    assert kv_dtype("torch.float16", KVCompression.FP8_E4M3) is torch.float16
    assert kv_dtype("fp8_e4m3", KVCompression.NONE) is None  # without compression the dtype does not matter
    with pytest.raises(ValueError, match=r"\['kvtriton_kv_compression'\]='fp8-e4m3'.*dtype is 'fp8_e4m3'"):
        kv_dtype("fp8_e4m3", KVCompression.FP8_E4M3)


def test_the_scheduler_row_is_about_half_a_bf16_row_and_bounds_every_split_of_it_into_page_tensors() -> None:
    raw = 2 * 16 * 8 * 128 * 2 * 4  # four layers of bf16 K and V pages
    assert host_row_bytes(raw, None, [("a", "b", "c", "d")]) == raw
    bound = host_row_bytes(raw, torch.bfloat16, [("a", "b", "c", "d")])
    assert bound == compressed_row_bytes(raw, torch.bfloat16, 4)
    assert 1.9 < raw / bound < 1.95
    # However the worker's tensors split the row (odd sizes included), its real row fits in the bound.
    for pages in ([raw // 2], [raw // 8] * 4, [raw // 16] * 8, [raw // 2 - 6, 6], [raw // 8 - 1, 1, raw // 8 * 3]):
        tensors = [torch.empty((1, elements), dtype=torch.bfloat16, device="meta") for elements in pages]
        assert compression_layout(tensors, 128).row_bytes <= bound, pages


def test_kvtriton_summary_interval_s_defaults_to_a_minute_and_zero_turns_it_off() -> None:
    assert KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 2**20}).summary_interval_s == 60
    assert (
        KVTritonOffloadConfig.from_extra_config(
            {"cpu_bytes_to_use": 2**20, "kvtriton_summary_interval_s": 0}
        ).summary_interval_s
        == 0
    )
    with pytest.raises(ValueError, match=r"kvtriton_summary_interval_s.*must be >= 0 seconds, got -5"):
        KVTritonOffloadConfig.from_extra_config({"cpu_bytes_to_use": 2**20, "kvtriton_summary_interval_s": -5})


USER_POLICIES = '''
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy


class _OverLRU(CachePolicy):
    """A user's policy: vLLM's LRU underneath, with the methods both releases require."""

    def __init__(self, cache_capacity):
        self.lru = LRUCachePolicy(cache_capacity)

    def get(self, key):
        return self.lru.get(key)

    def insert(self, key, chunk, req_context):
        self.lru.insert(key, chunk, req_context)

    def remove(self, key):
        self.lru.remove(key)

    def evict(self, n, protected):
        return self.lru.evict(n, protected)

    def clear(self):
        self.lru.clear()


class WrittenForVLLM033(_OverLRU):
    def touch(self, keys, req_context):
        pass


class WrittenForVLLM034(_OverLRU):
    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        pass
'''


@pytest.fixture
def user_policies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of user policies on the import path: one written for vLLM 0.33's CachePolicy, one for 0.34's."""
    (tmp_path / "user_policies_issue38.py").write_text(USER_POLICIES)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    return "user_policies_issue38"


def test_a_user_policy_written_for_vllm_0_33_is_refused_on_0_34_at_start_up_naming_on_request_finished(
    user_policies: str,
) -> None:
    surface = pytest.importorskip("kvtriton.integrations.vllm._surface")
    extra = {"cpu_bytes_to_use": 1, "eviction_policy": "WrittenForVLLM033", "cache_policy_module_path": user_policies}
    if not surface.POLICY_MUST_FINISH_REQUESTS:  # vLLM 0.33: its CachePolicy asks for touch, which the class has
        assert KVTritonOffloadConfig.from_extra_config(extra).uses_vllm_policy
        return
    with pytest.raises(ValueError) as refused:
        KVTritonOffloadConfig.from_extra_config(extra)
    message = str(refused.value)
    assert "\n" not in message
    assert f"{user_policies}.WrittenForVLLM033" in message and "does not implement on_request_finished" in message
    assert f"vLLM {surface.VLLM_VERSION}'s CachePolicy requires" in message
    assert "on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)" in message


def test_a_user_policy_written_for_vllm_0_34_is_refused_on_0_33_naming_touch(user_policies: str) -> None:
    surface = pytest.importorskip("kvtriton.integrations.vllm._surface")
    extra = {"cpu_bytes_to_use": 1, "eviction_policy": "WrittenForVLLM034", "cache_policy_module_path": user_policies}
    if not surface.MANAGER_HAS_TOUCH:  # vLLM 0.34: no touch anywhere, on_request_finished is the class's
        assert KVTritonOffloadConfig.from_extra_config(extra).uses_vllm_policy
        return
    with pytest.raises(ValueError, match=r"WrittenForVLLM034 .* does not implement touch, which vLLM 0\.33"):
        KVTritonOffloadConfig.from_extra_config(extra)


def test_the_tiered_spec_refuses_a_user_policy_for_the_other_release_at_construction(user_policies: str) -> None:
    surface = pytest.importorskip("kvtriton.integrations.vllm._surface")
    from tiering_fixtures.configs import tiering_config

    from kvtriton.integrations.vllm import KVTritonTieringOffloadingSpec

    stale = "WrittenForVLLM033" if surface.POLICY_MUST_FINISH_REQUESTS else "WrittenForVLLM034"
    extra = {"cpu_bytes_to_use": 1 << 20, "eviction_policy": stale, "cache_policy_module_path": user_policies}
    with pytest.raises(ValueError, match=f"{stale} .* does not implement"):
        KVTritonTieringOffloadingSpec(tiering_config(extra))
