"""Configuration errors of the tiered spec: each names what to change, and nothing is left allocated."""

from __future__ import annotations

import importlib.util
import os
import re
import uuid
import warnings
from pathlib import Path

import pytest

from kvtriton.manager import policy_names

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import torch
from tiering_fixtures.configs import OWN_ENGINE_PREFIX, own_engine_id, tiering_config
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from vllm.v1.kv_offload.tiering.backpressure import DropStorePolicy, EMABackpressureDetector
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_fixtures.in_process import workers_on_nodes

import kvtriton.worker._shared_region as shared_region
from kvtriton.integrations.vllm import KVTritonTieringOffloadingSpec
from kvtriton.integrations.vllm._surface import SECONDARY_TIERS_REFUSE_MULTI_NODE
from kvtriton.worker._slab import PageableSlabWarning

BUDGET: dict[str, object] = {"cpu_bytes_to_use": 1 << 20}


def region_files() -> set[str]:
    """This process's regions: tests running beside it in other processes create and remove their own."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("kvtriton_") and OWN_ENGINE_PREFIX in name}


def kv_caches(page_bytes: int) -> CanonicalKVCaches:
    tensor = torch.zeros(8, page_bytes, dtype=torch.int8)
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=tensor, page_size_bytes=page_bytes)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page_bytes)]],
    )


def test_an_unknown_tier_type_names_the_tier_and_the_registered_types() -> None:
    with pytest.raises(
        ValueError, match=r"secondary_tiers\[0\] \(type 'disk'\).*Unknown secondary tier type: 'disk'.*'fs'"
    ):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": [{"type": "disk"}]}))


def test_a_tier_module_path_that_cannot_be_imported_is_named() -> None:
    tiers = [
        {"type": "fs", "root_dir": "/tmp/kvtriton-unused"},
        {"type": "MyTier", "module_path": "no_such_package.tiers"},
    ]
    with pytest.raises(
        ImportError,
        match=r"secondary_tiers\[1\] \(type 'MyTier'\): module_path 'no_such_package.tiers' cannot be imported",
    ):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))


def test_an_fs_tier_without_root_dir_names_the_tier_and_the_key() -> None:
    tiers = [{"type": "fs"}]
    with pytest.raises(
        ValueError,
        match=r"^secondary_tiers\[0\] \(type 'fs'\) is missing the required key 'root_dir' \(FileSystemTierManager needs it\)$",
    ):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))


def test_an_unknown_tier_key_names_the_tier_the_key_and_what_it_takes() -> None:
    tiers = [{"type": "fs", "root_dir": "/tmp/kvtriton-unused", "rootdir": "/tmp"}]
    with pytest.raises(
        ValueError,
        match=r"secondary_tiers\[0\] \(type 'fs'\) has unknown key 'rootdir'; FileSystemTierManager takes \[.*'root_dir'",
    ):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))


def test_a_tier_class_missing_from_its_module_is_named() -> None:
    tiers = [{"type": "NoSuchTier", "module_path": "vllm.v1.kv_offload.tiering.fs.manager"}]
    with pytest.raises(ImportError, match=r"module 'vllm.v1.kv_offload.tiering.fs.manager' has no class 'NoSuchTier'"):
        KVTritonTieringOffloadingSpec.build_metric_definitions({**BUDGET, "secondary_tiers": tiers})


@pytest.mark.skipif(importlib.util.find_spec("nixl") is not None, reason="NIXL is installed here")
@pytest.mark.parametrize("kind", ["obj", "p2p"])
def test_a_tier_that_needs_nixl_says_how_to_install_it(kind: str) -> None:
    with pytest.raises(
        ImportError, match=rf"secondary_tiers\[0\] \(type '{kind}'\) needs the Python package 'nixl'.*pip install nixl"
    ):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": [{"type": kind}]}))


@pytest.mark.skipif(importlib.util.find_spec("kvcr") is not None, reason="kvcr is installed here")
def test_a_built_in_tier_whose_module_imports_a_missing_package_names_it() -> None:
    with pytest.raises(ImportError, match=r"\(type 'kvcr'\) needs the Python package 'kvcr'.*pip install kvcr"):
        KVTritonTieringOffloadingSpec.config_info_keys({**BUDGET, "secondary_tiers": [{"type": "kvcr"}]})


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [("n_read_threads", "4", "an integer"), ("n_write_threads", True, "an integer"), ("root_dir", 7, "a string"),
     ("enable_kv_events", "yes", "true or false"), ("locality", 3, "a string or null")],
)  # fmt: skip  # a table: one bad value a row, with what the error asks for
def test_a_tier_value_of_the_wrong_type_names_the_tier_and_the_key_before_anything_is_built(
    key: str, value: object, expected: str
) -> None:
    tiers = [{"type": "fs", "root_dir": "/tmp/kvtriton-unused", key: value}]
    got = f"{type(value).__name__} {re.escape(repr(value))}"
    message = rf"^secondary_tiers\[0\] \(type 'fs'\) key '{key}' must be {expected}, got {got}$"
    with pytest.raises(TypeError, match=message):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))


def test_a_root_dir_the_fs_tier_cannot_create_names_the_tier_and_the_key_and_frees_the_region(tmp_path: Path) -> None:
    before = region_files()
    tiers = [{"type": "fs", "root_dir": str(tmp_path)}, {"type": "fs", "root_dir": "/proc/kvtriton"}]
    spec = KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))
    message = r"^secondary_tiers\[1\] \(type 'fs'\) key 'root_dir'='/proc/kvtriton': the tier cannot use it \("
    with pytest.raises(ValueError, match=message):
        spec.get_manager()
    assert region_files() == before


def test_a_root_dir_other_users_may_enter_is_refused_naming_the_tier_and_its_mode(tmp_path: Path) -> None:
    # vLLM's fs tier writes its chunk files with the umask (0644): only a root nobody else may enter keeps them private.
    before = region_files()
    root = tmp_path / "kv"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    tiers = [{"type": "fs", "root_dir": str(root)}]
    spec = KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))
    message = rf"^secondary_tiers\[0\] \(type 'fs'\): key 'root_dir'='{root}' has mode 0755: every user on the host"
    with pytest.raises(ValueError, match=message):
        spec.get_manager()
    assert region_files() == before and list(root.iterdir()) == []


@pytest.mark.parametrize(
    ("root", "why"),
    [
        ("<a directory on local NVMe>", r"is a placeholder \(as `kvtriton simulate` prints it\): replace it"),
        ("", r"is empty: vLLM's fs tier would write its files under '/'"),
        ("kv-cache", r"is a relative path, .*give an absolute path"),
    ],
    ids=["simulate-placeholder", "empty", "relative"],
)
def test_a_root_dir_that_is_no_absolute_path_is_refused_at_start_naming_the_key_and_value(
    root: str, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    tiers = [{"type": "fs", "root_dir": root}]
    message = rf"^secondary_tiers\[0\] \(type 'fs'\) key 'root_dir'={re.escape(repr(root))} {why}"
    with pytest.raises(ValueError, match=message):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))
    assert list(tmp_path.iterdir()) == []  # no directory of the placeholder's (or any) name was made


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"backpressure_cls": "EMADetector"},
            r"key 'backpressure_cls'='EMADetector' names no class vLLM can import \(AttributeError: .*\); use a short "
            r"name from vllm\.v1\.kv_offload\.tiering\.backpressure \(EMABackpressureDetector\) or a dotted",
        ),
        (
            {"backpressure_cls": "no_such_module.Detector"},
            r"key 'backpressure_cls'='no_such_module.Detector' names no class vLLM can import \(ModuleNotFoundError",
        ),
        (
            {"backpressure_cls": "DropStorePolicy"},
            r"key 'backpressure_cls'='DropStorePolicy' is <class '.*DropStorePolicy'>, not a BackpressureDetector",
        ),
        (
            {"backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropPolicy"},
            r"key 'policy_cls'='DropPolicy' names no class .* \(DropStorePolicy, ThrottledDropPolicy\)",
        ),
    ],
    ids=["misspelt", "no-module", "a-policy", "bad-policy"],
)
@pytest.mark.parametrize("where", ["top-level", "tier"])
def test_a_bad_backpressure_class_is_refused_at_start_naming_the_key_and_the_choices(
    settings: dict[str, object], message: str, where: str
) -> None:
    tier: dict[str, object] = {"type": "fs", "root_dir": "/tmp/kvtriton-unused"}
    if where == "tier":
        extra: dict[str, object] = {**BUDGET, "secondary_tiers": [{**tier, "backpressure": settings}]}
        prefix = r"^secondary_tiers\[0\] \(type 'fs'\) key 'backpressure' "
    else:
        extra = {**BUDGET, "backpressure": settings, "secondary_tiers": [tier]}
        prefix = r"^kv_connector_extra_config\['backpressure'\] "
    with pytest.raises(ValueError, match=prefix + message):
        KVTritonTieringOffloadingSpec(tiering_config(extra))


def test_a_good_backpressure_class_builds_vllms_detector_and_policy(tmp_path: Path) -> None:
    settings = {"backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy"}
    tiers = [{"type": "fs", "root_dir": str(tmp_path / "kv"), "backpressure": settings}]
    manager = KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers})).get_manager()
    try:
        assert isinstance(manager, TieringOffloadingManager)
        (tier,) = manager.secondary_tiers
        assert isinstance(tier.bp_detector, EMABackpressureDetector)
        assert isinstance(tier.bp_detector.policy, DropStorePolicy)
    finally:
        manager.shutdown()


def test_a_shared_group_that_does_not_exist_is_refused_naming_the_key() -> None:
    extra: dict[str, object] = {**BUDGET, "kvtriton_shared_group": "no-such-group-kvtriton", "secondary_tiers": []}
    with pytest.raises(ValueError, match=r"\['kvtriton_shared_group'\]='no-such-group-kvtriton': no such group"):
        KVTritonTieringOffloadingSpec(tiering_config(extra))


def test_an_error_vllm_raises_while_building_a_tier_names_the_tier(tmp_path: Path) -> None:
    tiers = [{"type": "fs", "root_dir": str(tmp_path), "backpressure": {"high_water_s": 1.0}}]
    spec = KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))
    message = r"^secondary_tiers\[0\] \(type 'fs'\): backpressure config must include 'backpressure_cls'"
    with pytest.raises(ValueError, match=message):
        spec.get_manager()


def test_secondary_tiers_must_be_a_list() -> None:
    with pytest.raises(
        ValueError, match=r"secondary_tiers must be a list of tier configurations, got \{'type': 'fs'\}"
    ):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": {"type": "fs"}}))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, r"kv_connector_extra_config\['cpu_bytes_to_use'\] is required"),
        ({**BUDGET, "store_threshold": 2}, r"store_threshold'\]=2: the tiered spec stores every chunk"),
        (
            {**BUDGET, "eviction_policy": "fifo", "cache_policy_module_path": "my.policies"},
            r"\['cache_policy_module_path'\]='my.policies' cannot be imported "
            r"\(ModuleNotFoundError: No module named 'my'\)",
        ),
        ({**BUDGET, "eviction_polcy": "arc"}, r"nor vLLM reads: 'eviction_polcy' \(did you mean 'eviction_policy'\?\)"),
        (
            {**BUDGET, "tier_poll_interval_s": -1},
            r"\['tier_poll_interval_s'\] must be a number of seconds >= 0 .*got int -1$",
        ),
        ({**BUDGET, "tier_poll_interval_s": "fast"}, r"\['tier_poll_interval_s'\] must be a number .*got str 'fast'$"),
        ({**BUDGET, "backpressure": "yes"}, r"^kv_connector_extra_config\['backpressure'\] must be a mapping of"),
        (
            {**BUDGET, "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kvtriton-unused", "backpressure": "yes"}]},
            r"^secondary_tiers\[0\] \(type 'fs'\) key 'backpressure' must be a mapping of .*got str 'yes'",
        ),
        (
            {**BUDGET, "eviction_policy": "nosuch"},
            rf"\['eviction_policy'\] must be one of {re.escape(str(policy_names()))}, got 'nosuch': neither",
        ),
        (
            {"cpu_bytes_to_use": 100},
            r"\['cpu_bytes_to_use'\]=100: 100 bytes is less than one chunk of 4096 bytes; the value is in bytes",
        ),
        (
            {"cpu_bytes_to_use": 1e30},
            r"\['cpu_bytes_to_use'\]=1000000000000000019884624838656: .* exceed this host's \d+ bytes of RAM",
        ),
    ],
)
def test_bad_keys_are_refused_naming_key_and_value(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVTritonTieringOffloadingSpec(tiering_config(extra))


def test_dev_shm_too_small_is_refused_before_allocating_naming_both_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    before = region_files()
    monkeypatch.setattr(shared_region, "shm_free_bytes", lambda directory=shared_region.REGION_DIRECTORY: 4096)
    spec = KVTritonTieringOffloadingSpec(tiering_config(BUDGET))
    with pytest.raises(
        ValueError, match=r"/dev/shm has 4096 bytes free but the shared host region needs 1052672 bytes"
    ):
        spec.get_manager()
    assert region_files() == before


def test_uneven_pipeline_stages_are_refused_naming_both_layouts(tmp_path: Path) -> None:
    engine_id = own_engine_id("uneven")
    before = region_files()
    scheduler = KVTritonTieringOffloadingSpec(tiering_config(BUDGET, world_size=2, engine_id=engine_id))
    manager = scheduler.get_manager()
    # The second stage holds twice the layers, so twice the KV bytes per block.
    stage = KVTritonTieringOffloadingSpec(
        tiering_config(BUDGET, world_size=2, rank=1, engine_id=engine_id, worker_kv_bytes_per_block=4096)
    )
    with (
        warnings.catch_warnings(),
        pytest.raises(ValueError, match=r"laid out as .*x 2048 bytes.*expects .*x 4096 bytes.*VLLM_PP_LAYER_PARTITION"),
    ):
        warnings.simplefilter("ignore", PageableSlabWarning)
        stage.get_worker(kv_caches(4096))
    # A worker whose tensors outgrow the size vLLM reported is refused before mapping anything.
    wide = KVTritonTieringOffloadingSpec(tiering_config(BUDGET, world_size=2, rank=1, engine_id=engine_id))
    with pytest.raises(
        ValueError, match=r"rank 1's KV tensors hold 3072 bytes per block, but the shared region gives each rank 2048"
    ):
        wide.get_worker(kv_caches(3072))
    manager.shutdown()
    assert region_files() == before


def fs_tier(root: Path) -> dict[str, object]:
    """One fs secondary tier under ``root`` (a test's own folder: kvtriton makes it 0700, nothing lands in /tmp)."""
    return {"secondary_tiers": [{"type": "fs", "root_dir": str(root / "fs")}]}


@pytest.mark.skipif(
    not SECONDARY_TIERS_REFUSE_MULTI_NODE, reason="SECONDARY_TIERS_REFUSE_MULTI_NODE: vLLM 0.34 refuses, 0.33 does not"
)
def test_on_vllm_0_34_secondary_tiers_on_workers_across_nodes_are_refused_before_mapping_anything(
    tmp_path: Path,
) -> None:
    before = region_files()
    spec = KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, **fs_tier(tmp_path)}, world_size=2))
    with workers_on_nodes([0, 1]) as asked, pytest.raises(NotImplementedError) as refused:
        spec.get_worker(kv_caches(2048))
    message = str(refused.value)
    assert "\n" not in message and "KVTritonTieringOffloadingSpec: secondary_tiers (1 configured)" in message
    assert "span several nodes" in message and "run the engine on one node, or remove secondary_tiers" in message
    assert len(asked) == 1  # vLLM's own collective ran (the tensor-parallel group; the others have one rank)
    assert region_files() == before


@pytest.mark.skipif(
    not SECONDARY_TIERS_REFUSE_MULTI_NODE, reason="SECONDARY_TIERS_REFUSE_MULTI_NODE: vLLM 0.34 refuses, 0.33 does not"
)
def test_on_vllm_0_34_workers_on_one_node_take_part_in_the_check_and_get_their_worker(tmp_path: Path) -> None:
    engine_id = f"one-node-{uuid.uuid4().hex[:8]}"
    scheduler = KVTritonTieringOffloadingSpec(
        tiering_config({**BUDGET, **fs_tier(tmp_path)}, world_size=2, engine_id=engine_id)
    )
    manager = scheduler.get_manager()
    spec = KVTritonTieringOffloadingSpec(
        tiering_config({**BUDGET, **fs_tier(tmp_path)}, world_size=2, engine_id=engine_id)
    )
    with workers_on_nodes([0, 0]) as asked, warnings.catch_warnings():
        warnings.simplefilter("ignore", PageableSlabWarning)
        worker = spec.get_worker(kv_caches(2048))
    assert len(asked) == 1
    worker.shutdown()
    manager.shutdown()


def test_a_single_worker_or_an_engine_without_secondary_tiers_asks_no_node_question(tmp_path: Path) -> None:
    for extra, world_size in (({**BUDGET, **fs_tier(tmp_path)}, 1), (BUDGET, 2)):
        engine_id = f"no-question-{uuid.uuid4().hex[:8]}"
        scheduler = KVTritonTieringOffloadingSpec(tiering_config(extra, world_size=world_size, engine_id=engine_id))
        manager = scheduler.get_manager()
        spec = KVTritonTieringOffloadingSpec(tiering_config(extra, world_size=world_size, engine_id=engine_id))
        with workers_on_nodes([0, 1]) as asked, warnings.catch_warnings():  # a refusal, were the question asked
            warnings.simplefilter("ignore", PageableSlabWarning)
            spec.get_worker(kv_caches(2048)).shutdown()
        manager.shutdown()
        assert asked == []
