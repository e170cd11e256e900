"""KVTritonOffloadingSpec as vLLM loads and sizes it; vLLM stays an optional dependency."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvtriton.integrations._vllm_release import TESTED_VLLM_RANGE
from kvtriton.manager import policy_names

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import torch
from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm_fixtures.builders import SPEC_EXTRA_CONFIG, canonical_kv_caches, offloading_config
from vllm_fixtures.connector import submit_load, submit_store

import kvtriton.integrations.vllm._single_tier_spec as single_tier_spec
import kvtriton.worker._slab as slab_module
from kvtriton.integrations.vllm import (
    KVTritonOffloadingSpec,
    VLLMOffloadingManager,
    VLLMOffloadingWorker,
    open_host_slab,
)
from kvtriton.integrations.vllm._manager import STORE_OFFER_SIGNAL
from kvtriton.manager import CPUOffloadingManager, FilterReusedOffloadingManager
from kvtriton.worker._slab import HostSlab, PageableSlabWarning, SlabPinningError

ROOT = Path(__file__).resolve().parents[3]


def test_vllms_factory_loads_the_spec_from_spec_name_and_module_path() -> None:
    spec_cls = OffloadingSpecFactory.get_spec_cls(SPEC_EXTRA_CONFIG)
    assert spec_cls is KVTritonOffloadingSpec
    assert issubclass(spec_cls, OffloadingSpec)


def test_vllms_factory_creates_the_spec_from_an_offloading_config() -> None:
    spec = OffloadingSpecFactory.create_spec(offloading_config({"cpu_bytes_to_use": 10 * 1024}))
    assert isinstance(spec, KVTritonOffloadingSpec)
    assert isinstance(spec.get_manager(), VLLMOffloadingManager)


def test_the_slab_holds_this_ranks_share_of_cpu_bytes_to_use_in_whole_chunks(caplog: pytest.LogCaptureFixture) -> None:
    # 4 ranks share 1 MiB: 256 KiB each; a chunk is 4 blocks x 1000 bytes, so 65 slots fit.
    config = offloading_config(
        {"cpu_bytes_to_use": 1 << 20}, worker_kv_bytes_per_block=1000, blocks_per_chunk=4, world_size=4, rank=2
    )
    with caplog.at_level(logging.INFO, logger="kvtriton.integrations.vllm"):
        spec = KVTritonOffloadingSpec(config)
    assert spec.num_slots == (1 << 18) // 4000 == 65
    assert "rank 2 of 4" in caplog.text and "262144 bytes for this rank" in caplog.text
    assert spec.cpu_info == CPUOffloadingInfo(
        cpu_num_chunks=65,
        cpu_blocks_per_chunk=4,
        cpu_kv_cache_size_bytes=65 * 4000 * 4,
        cpu_kv_cache_size_tokens=65 * 1024 // (1024 // 64),
    )


def test_every_rank_and_the_scheduler_agree_on_the_slot_count() -> None:
    counts = {
        KVTritonOffloadingSpec(offloading_config({"cpu_bytes_to_use": 5 << 20}, world_size=2, rank=rank)).num_slots
        for rank in range(2)
    }
    assert counts == {(5 << 20) // 2 // 1024}


def test_a_budget_below_one_chunk_raises() -> None:
    with pytest.raises(
        ValueError,
        match=r"\['cpu_bytes_to_use'\]=1000: 1000 bytes is less than one slot of 1024 bytes; the value is in bytes",
    ):
        KVTritonOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1000}, worker_kv_bytes_per_block=1024))


def test_a_missing_budget_raises_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"\['cpu_bytes_to_use'\] is required"):
        KVTritonOffloadingSpec(offloading_config({}))


def test_the_canonical_host_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="canonical"):
        KVTritonOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 20}, canonical_layout=True))


def test_the_summary_interval_reaches_the_adapter() -> None:
    manager = KVTritonOffloadingSpec(
        offloading_config({"cpu_bytes_to_use": 1 << 20, "kvtriton_summary_interval_s": 5})
    ).get_manager()
    assert isinstance(manager, VLLMOffloadingManager)
    assert manager.summary_interval_s == 5


def test_store_threshold_below_two_stores_everything_and_two_or_more_filters() -> None:
    plain = KVTritonOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 20, "store_threshold": 1}))
    plain_manager = plain.get_manager()
    assert isinstance(plain_manager, VLLMOffloadingManager)
    assert isinstance(plain_manager.backing, CPUOffloadingManager)

    filtered = KVTritonOffloadingSpec(
        offloading_config({"cpu_bytes_to_use": 1 << 20, "store_threshold": 3, "max_tracker_size": 10})
    )
    filtered_manager = filtered.get_manager()
    assert isinstance(filtered_manager, VLLMOffloadingManager)
    backing = filtered_manager.backing
    assert isinstance(backing, FilterReusedOffloadingManager)
    assert (backing.store_threshold, backing.max_tracker_size) == (3, 10)
    # The installed vLLM's admission rule (each offer on 0.33, a request's first offer on 0.34).
    assert backing.count_on is STORE_OFFER_SIGNAL
    assert filtered.get_manager() is filtered_manager  # one manager per spec


def test_the_metrics_and_info_labels_it_declares_are_vllms_cpu_tier_names() -> None:
    definitions = KVTritonOffloadingSpec.build_metric_definitions({})
    assert set(definitions) == {
        "vllm:kv_offload_cpu_cache_usage_perc",
        "vllm:kv_offload_cpu_cache_write_usage_perc",
        "vllm:kv_offload_cpu_cache_read_usage_perc",
        "vllm:kv_offload_cpu_allocation_size",  # vLLM's histogram
        "vllm:kv_offload_cpu_cache_occupancy_perc",  # kvtriton's occupancy gauge
    }
    assert KVTritonOffloadingSpec.config_info_keys({}) == CPUOffloadingInfo.config_info_keys()


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_import_kvtriton_never_imports_vllm() -> None:
    result = _run_python(
        """
        import sys
        import kvtriton, kvtriton.manager, kvtriton.integrations, kvtriton.sim, kvtriton.cli
        print(sorted(name for name in sys.modules if name == "vllm" or name.startswith("vllm.")))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_adapter_names_the_extra_to_install_when_vllm_is_absent() -> None:
    # sys.modules["vllm"] = None is how Python spells "this package cannot be imported".
    result = _run_python(
        """
        import sys
        sys.modules["vllm"] = None
        try:
            import kvtriton.integrations.vllm
        except ImportError as error:
            print(error)
        """
    )
    assert result.returncode == 0, result.stderr
    assert f"pip install 'vllm{TESTED_VLLM_RANGE}'" in result.stdout


_BLOCKER = """
import importlib.abc
import sys

class Blocker(importlib.abc.MetaPathFinder):
    \"\"\"Makes the named modules (and their submodules) unimportable, as if not installed.\"\"\"

    def __init__(self, *names):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == name or fullname.startswith(name + ".") for name in self.names):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None
"""


@pytest.mark.parametrize(
    ("blocked", "expected"),
    [
        (("vllm",), f"pip install 'vllm{TESTED_VLLM_RANGE}'"),
        # An older vLLM: the package imports, the offloading interface does not.
        (("vllm.v1.kv_offload.config",), "supports vLLM 0.33.x, 0.34.x"),
    ],
)
def test_without_a_usable_vllm_the_adapter_raises_an_import_error_saying_what_to_install(
    blocked: tuple[str, ...], expected: str
) -> None:
    result = _run_python(
        _BLOCKER
        + f"""
sys.meta_path.insert(0, Blocker(*{blocked!r}))
try:
    import kvtriton.integrations.vllm
except ImportError as error:
    print(type(error).__name__, error)
    print("cause:", error.__cause__)
else:
    print("imported")
"""
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ImportError ") and expected in result.stdout, result.stdout
    assert "cause: No module named" in result.stdout  # the original error stays attached


def test_pyright_sees_vllms_real_types(tmp_path: Path) -> None:
    # `make typecheck` holds the adapter to pyright strict; that means something only if pyright reads vLLM's
    # annotations (py.typed) rather than Unknown: a probe that misuses a vLLM type must fail.
    probe = tmp_path / "probe.py"
    probe.write_text("from vllm.v1.kv_offload.base import LookupResult\n\nresult: int = LookupResult.MISS\n")
    result = subprocess.run(
        [sys.executable, "-m", "pyright", "--outputjson", str(probe)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    report = json.loads(result.stdout)
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    assert [(Path(d["file"]).name, d["rule"]) for d in errors] == [("probe.py", "reportAssignmentType")]


class RegistrarStub:
    """Stands in for the CUDA runtime's host registration: fails every call with ``error`` (0: succeeds)."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.registered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 -- the CUDA name
        if not self.error:
            self.registered.append(ptr)
        return self.error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 -- the CUDA name
        self.registered.remove(ptr)
        return 0

    def cudaGetLastError(self) -> int:  # noqa: N802 -- the CUDA name
        return 0


CUDA = torch.device("cuda")


def as_if_on_cuda(monkeypatch: pytest.MonkeyPatch, error: int) -> RegistrarStub:
    """Make the slab believe CUDA is there, with a registration that fails with ``error`` (0: works)."""
    registrar = RegistrarStub(error)
    monkeypatch.setattr(slab_module, "_cuda_available", lambda: True)
    monkeypatch.setattr(slab_module, "_registrar", lambda: registrar)
    monkeypatch.setattr(slab_module, "memlock_limit_bytes", lambda: 65536)
    return registrar


def test_a_cuda_worker_whose_slab_cannot_be_pinned_fails_with_one_line_saying_how_to_fix_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    as_if_on_cuda(monkeypatch, error=2)
    with pytest.raises(SlabPinningError) as raised:
        open_host_slab(4, 2, 1000, device=CUDA, pageable_allowed=False)
    message = str(raised.value)
    assert "\n" not in message
    assert "cannot pin the 8000-byte host slab" in message
    assert "RLIMIT_MEMLOCK is 65536 bytes" in message and "MemAvailable is" in message and "ulimit" not in message
    assert "kv_connector_extra_config['kvtriton_pageable_slab']=true" in message


def test_with_kvtriton_pageable_slab_a_slab_that_cannot_be_pinned_stays_pageable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    as_if_on_cuda(monkeypatch, error=2)
    with pytest.warns(PageableSlabWarning, match="stays pageable"):
        slab = open_host_slab(4, 2, 1000, device=CUDA, pageable_allowed=True)
    assert not slab.pinned and slab.rows.shape == (8, 1000)
    slab.close()


def test_a_cuda_worker_pins_its_slab(monkeypatch: pytest.MonkeyPatch) -> None:
    registrar = as_if_on_cuda(monkeypatch, error=0)
    slab = open_host_slab(4, 2, 1000, device=CUDA, pageable_allowed=False)
    assert slab.pinned and registrar.registered
    slab.close()
    assert not registrar.registered


def test_the_spec_hands_kvtriton_pageable_slab_to_the_slab(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []

    def recording_open_host_slab(
        num_slots: int, block_size_factor: int, row_bytes: int, *, device: torch.device, pageable_allowed: bool
    ) -> HostSlab:
        asked.append(pageable_allowed)
        return HostSlab(num_slots, block_size_factor, row_bytes, pin=False)

    monkeypatch.setattr(single_tier_spec, "open_host_slab", recording_open_host_slab)
    for value in (True, False):
        spec = KVTritonOffloadingSpec(
            offloading_config(
                {"cpu_bytes_to_use": 1 << 16, "kvtriton_pageable_slab": value}, worker_kv_bytes_per_block=64
            )
        )
        spec.get_worker(canonical_kv_caches([torch.zeros(4, 64, dtype=torch.int8)])).shutdown()
    assert asked == [True, False]


VLLM_LRU_BY_PATH: dict[str, object] = {
    "eviction_policy": "LRUCachePolicy",
    "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.lru",
}
"""vLLM's own LRU loaded out of tree, as a user's policy would be (vLLM's CachePolicyFactory resolves it)."""


def test_a_vllm_policy_runs_vllms_manager_and_kvtritons_worker_moves_the_bytes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VLLMManager
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    page = 64
    with caplog.at_level(logging.INFO, logger="kvtriton.integrations.vllm"):
        spec = KVTritonOffloadingSpec(
            offloading_config({"cpu_bytes_to_use": 4 * page, **VLLM_LRU_BY_PATH}, worker_kv_bytes_per_block=page)
        )
    assert (
        "eviction_policy 'LRUCachePolicy' is not kvtriton's: vLLM's own CPUOffloadingManager ranks and evicts with "
        "vllm.v1.kv_offload.cpu.policies.lru.LRUCachePolicy"
    ) in caplog.text
    manager = spec.get_manager()
    assert type(manager) is VLLMManager
    assert isinstance(manager._policy, LRUCachePolicy)  # pyright: ignore[reportPrivateUsage] -- which policy vLLM resolved
    layer = torch.arange(8 * page, dtype=torch.int64).to(torch.uint8).view(8, page).clone()
    original = layer.clone()
    caches = canonical_kv_caches([layer])
    worker = spec.get_worker(caches)
    context = ReqContext(req_id="r1")
    keys = [make_offload_key(b"a", 0), make_offload_key(b"b", 0)]
    stored = manager.prepare_store(keys, context)
    assert stored is not None
    assert submit_store(worker, caches, 0, GPULoadStoreSpec([1, 5], [2], [0]), stored.store_spec)
    worker.wait({0})
    manager.complete_store(keys, context)
    layer.zero_()
    assert submit_load(worker, caches, 1, manager.prepare_load(keys, context), GPULoadStoreSpec([2, 3], [2], [0]))
    worker.wait({1})
    manager.complete_load(keys, context)
    assert torch.equal(layer[2], original[1]) and torch.equal(layer[3], original[5])
    worker.shutdown()


def test_a_vllm_policy_keeps_vllms_reuse_filter_and_its_metrics() -> None:
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    extra: dict[str, object] = {"cpu_bytes_to_use": 4096, "store_threshold": 2, **VLLM_LRU_BY_PATH}
    assert (
        KVTritonOffloadingSpec.build_metric_definitions(extra).keys()
        == CPUOffloadingSpec.build_metric_definitions(extra).keys()
    )
    assert CPUOffloadingMetrics.STORES_SKIPPED in KVTritonOffloadingSpec.build_metric_definitions(extra)
    manager = KVTritonOffloadingSpec(offloading_config(extra)).get_manager()
    assert getattr(manager, "store_threshold") == 2


def test_a_policy_neither_kvtriton_nor_vllm_knows_is_refused_naming_the_key() -> None:
    with pytest.raises(
        ValueError,
        match=rf"\['eviction_policy'\] must be one of {re.escape(str(policy_names()))}, got 'nosuch': neither kvtriton's "
        r"policies nor vLLM's CachePolicyFactory",
    ):
        KVTritonOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 20, "eviction_policy": "nosuch"}))


def test_a_fractional_budget_from_kv_offloading_size_rounds_down() -> None:
    spec = KVTritonOffloadingSpec(
        offloading_config({"cpu_bytes_to_use": 2.5 * 1024 + 0.7}, worker_kv_bytes_per_block=1024)
    )
    assert spec.num_slots == 2


def test_an_impossible_budget_is_refused_when_the_spec_is_built() -> None:
    with pytest.raises(
        ValueError, match=r"\['cpu_bytes_to_use'\]=\d+: \d+ bytes per rank exceed this host's \d+ bytes of RAM"
    ):
        KVTritonOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1e30}))


def test_a_typo_in_the_extra_config_stops_the_spec_naming_the_key_and_the_closest_valid_one() -> None:
    with pytest.raises(ValueError, match=r"nor vLLM reads: 'eviction_polcy' \(did you mean 'eviction_policy'\?\)"):
        KVTritonOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 20, "eviction_polcy": "arc"}))


def test_a_tiered_only_key_in_the_single_tier_spec_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtriton.integrations.vllm._config"):
        KVTritonOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": []}))
    assert "ignoring kv_connector_extra_config['secondary_tiers']: only the tiered spec" in caplog.text


def test_the_old_cache_policy_key_is_refused_pointing_at_eviction_policy() -> None:
    # Following a hint to cache_policy_module_path would have run vLLM's LRU instead of kvtriton's ARC.
    message = r"'cache_policy' \(did you mean 'eviction_policy'\? 'cache_policy' is the manager's argument"
    with pytest.raises(ValueError, match=message):
        KVTritonOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 20, "cache_policy": "arc"}))


def test_vllms_own_offloading_flags_merge_the_budget_into_kvtritons_config() -> None:
    """--kv-offloading-size 2.3 --kv-offloading-backend native (CacheConfig's two fields) beside a
    --kv-transfer-config naming kvtriton: vLLM sets the connector and role and merges a fractional budget."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig

    cache = CacheConfig(kv_offloading_size=2.3, kv_offloading_backend="native")
    given = KVTransferConfig(kv_connector_extra_config=dict(SPEC_EXTRA_CONFIG))
    transfer = VllmConfig(
        cache_config=cache, kv_transfer_config=given, device_config=DeviceConfig("cpu")
    ).kv_transfer_config
    assert transfer is not None
    assert (transfer.kv_connector, transfer.kv_role) == ("OffloadingConnector", "kv_both")
    assert transfer.kv_connector_extra_config == {**SPEC_EXTRA_CONFIG, "cpu_bytes_to_use": 2.3 * (1 << 30)}
    spec = KVTritonOffloadingSpec(
        offloading_config(transfer.kv_connector_extra_config, worker_kv_bytes_per_block=1 << 20)
    )
    assert spec.settings.cpu_bytes_to_use == int(2.3 * (1 << 30)) and spec.num_slots == 2355


# A realistic layer's block: K and V of 16 tokens x 8 heads x 128 dims in bf16.
BF16_BLOCK = 2 * 16 * 8 * 128 * 2


def bf16_config(extra: dict[str, object], **kwargs: Any) -> OffloadingConfig:
    config = offloading_config(extra, worker_kv_bytes_per_block=BF16_BLOCK, **kwargs)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"))


def test_compression_buys_about_1_9x_the_slots_in_the_same_budget_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    budget = 1000 * BF16_BLOCK
    plain = KVTritonOffloadingSpec(bf16_config({"cpu_bytes_to_use": budget}))
    with caplog.at_level(logging.INFO, logger="kvtriton.integrations.vllm"):
        compressed = KVTritonOffloadingSpec(
            bf16_config({"cpu_bytes_to_use": budget, "kvtriton_kv_compression": "fp8-e4m3"})
        )
    assert plain.num_slots == 1000 and plain.row_bytes == BF16_BLOCK
    assert 1.9 < compressed.num_slots / plain.num_slots < 1.95
    assert compressed.num_slots == budget // compressed.row_bytes
    assert compressed.cpu_info.cpu_kv_cache_size_bytes == compressed.num_slots * compressed.row_bytes
    assert "kv_compression=fp8-e4m3" in caplog.text and "x the slots" in caplog.text
    assert plain.kv_dtype is None and compressed.kv_dtype is torch.bfloat16


def test_compression_on_a_kv_cache_it_cannot_compress_is_refused_when_the_spec_is_built() -> None:
    config = offloading_config({"cpu_bytes_to_use": 1 << 20, "kvtriton_kv_compression": "fp8-e4m3"})
    fp8 = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="fp8_e4m3"))
    with pytest.raises(ValueError, match=r"\['kvtriton_kv_compression'\]='fp8-e4m3' compresses .* dtype is 'fp8_e4m3'"):
        KVTritonOffloadingSpec(fp8)


def test_a_vllm_policy_carries_compression_vllms_manager_hands_out_slots_kvtritons_worker_compresses() -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VLLMManager

    from kvtriton.kernels._compression import KVCompression

    extra: dict[str, object] = {
        "cpu_bytes_to_use": 4 * BF16_BLOCK,
        "kvtriton_kv_compression": "fp8-e4m3",
        **VLLM_LRU_BY_PATH,
    }
    spec = KVTritonOffloadingSpec(bf16_config(extra))
    assert spec.num_slots == 7  # 4 raw blocks' bytes hold 7 compressed ones
    manager = spec.get_manager()
    assert type(manager) is VLLMManager
    layer = (torch.randn((8, BF16_BLOCK // 2), generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    original = layer.clone()
    worker = spec.get_worker(canonical_kv_caches([layer]))
    assert isinstance(worker, VLLMOffloadingWorker)
    (engine,) = worker.engines
    assert engine.kv.compression is KVCompression.FP8_E4M3
    context = ReqContext(req_id="r1")
    keys = [make_offload_key(b"a", 0)]
    stored = manager.prepare_store(keys, context)
    assert stored is not None
    assert worker.submit_store(0, GPULoadStoreSpec([5], [1], [0]), stored.store_spec)
    worker.wait({0})
    (result,) = worker.get_finished()
    assert result.transfer_size == engine.kv.row_bytes < BF16_BLOCK // 1.9
    manager.complete_store(keys, context)
    layer.zero_()
    assert worker.submit_load(1, manager.prepare_load(keys, context), GPULoadStoreSpec([2], [1], [0]))
    worker.wait({1})
    manager.complete_load(keys, context)
    assert torch.allclose(layer[2].float(), original[5].float(), rtol=2**-4, atol=1e-2)
    worker.shutdown()


@pytest.mark.parametrize(
    "policy", [{"eviction_policy": "lru"}, VLLM_LRU_BY_PATH], ids=["kvtriton-manager", "vllm-manager"]
)
def test_verify_host_loads_shows_in_the_start_up_line_and_as_a_config_info_label(
    caplog: pytest.LogCaptureFixture, policy: dict[str, object]
) -> None:
    extra: dict[str, object] = {"cpu_bytes_to_use": 1 << 20, **policy}
    verified: dict[str, object] = {**extra, "kvtriton_verify_host_loads": True}
    keys = KVTritonOffloadingSpec.config_info_keys(verified)
    assert keys == (*CPUOffloadingInfo.config_info_keys(), "kvtriton_verify_host_loads")
    with caplog.at_level(logging.INFO, logger="kvtriton.integrations.vllm"):
        spec = KVTritonOffloadingSpec(offloading_config(verified))
    (line,) = [record.getMessage() for record in caplog.records if "kvtriton offloading (rank" in record.getMessage()]
    assert line.endswith(single_tier_spec.VERIFY_HOST_LOADS_NOTE) and "kvtriton_verify_host_loads=true" in line
    manager = spec.get_manager()
    try:
        (info,) = manager.config_info()
        assert set(info) == set(keys) and info["kvtriton_verify_host_loads"] is True
    finally:
        manager.shutdown()
    # Off (the default): vLLM's labels alone, and the line says nothing of it.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvtriton.integrations.vllm"):
        plain = KVTritonOffloadingSpec(offloading_config(extra))
    assert KVTritonOffloadingSpec.config_info_keys(extra) == CPUOffloadingInfo.config_info_keys()
    assert type(plain.cpu_info) is CPUOffloadingInfo
    assert "verify_host_loads" not in caplog.text
