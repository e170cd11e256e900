"""The vLLM surface (kvtriton.integrations.vllm._surface): the one importer of vLLM, the release check, and each vLLM private name kvtriton relies on still meaning it in this vLLM.

Every check fails with the inventory entry's name, so a vLLM release that
renames or changes one says which, before anything fails at run time.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from tiering_fixtures.configs import tiering_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering import backpressure
from vllm.v1.kv_offload.tiering import factory as tier_factory
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

import kvtriton
from kvtriton.integrations.vllm import _surface as surface
from kvtriton.integrations.vllm._surface import (
    ALLOW_UNTESTED_VLLM,
    FACTORY_ARGUMENTS,
    FACTORY_KEYS,
    MULTI_NODE_REFUSAL,
    RESTATED_TIERING_SPEC_ATTRIBUTES,
    TESTED_VLLM_RELEASES,
    TIER_CLASS_REFUSED,
    VLLM_PRIVATE_NAMES,
    VLLM_RELEASE,
    VLLM_VERSION,
    VLLMPrivateName,
    check_vllm_release,
    registered_cache_policies,
    vllm_release,
    with_model_name,
)


def _entry(key: str) -> VLLMPrivateName:
    return next(entry for entry in VLLM_PRIVATE_NAMES if entry.key == key)


def _check_policy_registry() -> None:
    assert {"lru", "arc"} <= set(registered_cache_policies())


def _check_secondary_tiers_hook() -> None:
    hook = inspect.getattr_static(TieringOffloadingSpec, "_get_secondary_tiers")
    assert isinstance(hook, classmethod)
    assert list(inspect.signature(TieringOffloadingSpec._get_secondary_tiers).parameters) == ["extra_config"]  # pyright: ignore[reportPrivateUsage] -- the name under test
    # vLLM's spec reaches its tiers through the hook, so kvtriton's override is what runs.
    assert "cls._get_secondary_tiers(" in inspect.getsource(TieringOffloadingSpec)


def _check_primary_num_chunks() -> None:
    assert "primary_tier._num_chunks" in inspect.getsource(TieringOffloadingManager)


def _check_restated_spec_attributes() -> None:
    spec = _vllm_tiering_spec()
    missing = [name for name in RESTATED_TIERING_SPEC_ATTRIBUTES if not hasattr(spec, name)]
    assert not missing, f"vLLM's TieringOffloadingSpec no longer sets {missing}"


def _check_tier_class_assertion() -> None:
    with pytest.raises(TIER_CLASS_REFUSED):
        SecondaryTierFactory.get_tier_class({"type": "OrderedDict", "module_path": "collections"})  # pyright: ignore[reportUnknownMemberType] -- vLLM annotates tier configs as a bare dict


def _check_tier_factory_arguments() -> None:
    source = inspect.getsource(SecondaryTierFactory)  # the class: its create_secondary_tier is typed with a bare dict
    filled = {name for name in FACTORY_ARGUMENTS - {"self"} if f"{name}=" in source}
    assert filled == FACTORY_ARGUMENTS - {"self"}, f"the factory fills {sorted(filled)}"
    consumed = {key for key in FACTORY_KEYS if f'pop("{key}"' in source}
    assert consumed == FACTORY_KEYS, f"the factory consumes {sorted(consumed)}"
    parameters = inspect.signature(SecondaryTierManager.__init__).parameters
    assert set(parameters) >= FACTORY_ARGUMENTS


def _vllm_tiering_spec() -> TieringOffloadingSpec:
    """vLLM's own tiered spec (no secondary tier): building it allocates nothing."""
    return TieringOffloadingSpec(tiering_config({"cpu_bytes_to_use": 1 << 16, "spec_name": "TieringOffloadingSpec"}))


def _check_model_name_namespace() -> None:
    spec = _vllm_tiering_spec()
    renamed = copy.copy(spec)
    renamed.config = with_model_name(spec.config, "other-model")
    assert renamed.config.model.name == "other-model" and spec.config.model.name != "other-model"
    roots = {FileMapper.from_offloading_spec("/root", one).base_path for one in (spec, renamed)}
    assert len(roots) == 2


class _RecordingRegion:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def create_kv_memoryview(self) -> memoryview:
        self.calls.append("create_kv_memoryview")
        return memoryview(bytearray(4 * 64)).cast("B", (4, 64))

    def cleanup(self) -> None:
        self.calls.append("cleanup")


def _check_primary_region_methods() -> None:
    region = _RecordingRegion()
    primary = CPUPrimaryTierOffloadingManager(
        num_chunks=4,
        mmap_region=region,  # pyright: ignore[reportArgumentType] -- the duck type under test
        cache_policy="lru",
        enable_events=False,
    )
    primary.shutdown()
    assert region.calls == ["create_kv_memoryview", "cleanup"]


def _check_promotion_hooks() -> None:
    complete = inspect.signature(TieringOffloadingManager._complete_promotion)  # pyright: ignore[reportPrivateUsage] -- the name under test
    assert list(complete.parameters) == ["self", "job_metadata", "completed_job"]
    initiate = inspect.signature(TieringOffloadingManager._initiate_promotion)  # pyright: ignore[reportPrivateUsage] -- the name under test
    assert list(initiate.parameters) == ["self", "tier_idx", "key", "req_context"]
    source = inspect.getsource(TieringOffloadingManager)
    # The hooks are what vLLM's own steps call: the verdict reaches complete_write, a False answers MISS.
    assert "self._complete_promotion(job_metadata, completed_job)" in source
    assert "promoted = self._initiate_promotion(i, key, req_context)" in source
    assert "self.primary_tier.complete_write(" in inspect.getsource(TieringOffloadingManager._complete_promotion)  # pyright: ignore[reportPrivateUsage] -- the name under test


def _check_multi_node_refusal() -> None:
    import vllm.v1.kv_offload.tiering.spec as tiering_spec

    refusal = getattr(tiering_spec, MULTI_NODE_REFUSAL, None)
    assert (refusal is not None) is surface.SECONDARY_TIERS_REFUSE_MULTI_NODE
    if refusal is not None:
        assert callable(refusal) and not inspect.signature(refusal).parameters
        assert f"{MULTI_NODE_REFUSAL}()" in inspect.getsource(TieringOffloadingSpec.create_worker)


def _check_fs_file_mapper() -> None:
    assert "self.file_mapper = FileMapper" in inspect.getsource(FileSystemTierManager.__init__)
    assert callable(FileMapper.get_file_name)


def _check_connector_vllm_config() -> None:
    parameters = inspect.signature(OffloadingConnector.__init__).parameters
    assert list(parameters) == ["self", "vllm_config", "role", "kv_cache_config"]
    # The spec is built inside the constructor, while its vllm_config argument is on the stack.
    assert "OffloadingSpecFactory.create_spec(" in inspect.getsource(OffloadingConnector.__init__)


def _check_backpressure_class_import() -> None:
    assert tier_factory._DEFAULT_PACKAGE == backpressure.__name__  # pyright: ignore[reportPrivateUsage] -- the name under test
    assert tier_factory._import_class("EMABackpressureDetector") is backpressure.EMABackpressureDetector  # pyright: ignore[reportPrivateUsage] -- the name under test
    assert tier_factory._import_class(f"{backpressure.__name__}.DropStorePolicy") is backpressure.DropStorePolicy  # pyright: ignore[reportPrivateUsage] -- the name under test
    # The factory resolves both keys with it, so kvtriton's start-up check resolves what the factory will.
    source = inspect.getsource(SecondaryTierFactory)
    assert "_import_class(bp_cls_name)" in source and "_import_class(policy_cls_name)" in source


def _check_request_context_factory() -> None:
    module = importlib.import_module(surface.REQ_CONTEXT_FACTORY_MODULE)
    factory = getattr(module, surface.REQ_CONTEXT_FACTORY)
    assert next(iter(inspect.signature(factory).parameters)) == "req"
    # The connector builds every request's context through the module's name, so the hook's wrapper is what runs.
    source = inspect.getsource(module)
    assert source.count(f"{surface.REQ_CONTEXT_FACTORY}(request") >= 2


CHECKS: dict[str, Callable[[], None]] = {
    "backpressure_class_import": _check_backpressure_class_import,
    "connector_vllm_config": _check_connector_vllm_config,
    "promotion_hooks": _check_promotion_hooks,
    "request_context_factory": _check_request_context_factory,
    "fs_file_mapper": _check_fs_file_mapper,
    "multi_node_refusal": _check_multi_node_refusal,
    "policy_registry": _check_policy_registry,
    "secondary_tiers_hook": _check_secondary_tiers_hook,
    "primary_num_chunks": _check_primary_num_chunks,
    "restated_spec_attributes": _check_restated_spec_attributes,
    "tier_class_assertion": _check_tier_class_assertion,
    "tier_factory_arguments": _check_tier_factory_arguments,
    "model_name_namespace": _check_model_name_namespace,
    "primary_region_methods": _check_primary_region_methods,
}


def test_every_inventory_entry_has_one_check() -> None:
    assert sorted(entry.key for entry in VLLM_PRIVATE_NAMES) == sorted(CHECKS)


@pytest.mark.parametrize("key", sorted(CHECKS))
def test_the_installed_vllm_still_has_the_private_name(key: str) -> None:
    entry = _entry(key)
    try:
        CHECKS[key]()
    except Exception as error:  # noqa: BLE001 -- any failure means the name changed; the message names it
        pytest.fail(
            f"vLLM changed {entry.name} (used by {entry.used_by}: {entry.why}): {type(error).__name__}: {error}"
        )


def test_every_inventory_entry_names_a_kvtriton_module_that_exists() -> None:
    root = Path(__file__).resolve().parents[3]
    for entry in VLLM_PRIVATE_NAMES:
        assert (root / (entry.used_by.replace(".", "/") + ".py")).is_file(), entry.used_by


def test_only_the_surface_imports_vllm() -> None:
    """Every vLLM name the package uses comes through kvtriton.integrations.vllm._surface (one edit per release)."""
    root = Path(__file__).resolve().parents[3] / "kvtriton"
    importers: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if (
            path.relative_to(root).as_posix() == "integrations/vllm/_surface.py"
            or "kernels" in path.relative_to(root).parts
        ):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            else:
                continue
            if any(module == "vllm" or module.startswith("vllm.") for module in modules):
                importers.append(f"{path.relative_to(root)}:{node.lineno}")
    assert importers == []


@pytest.mark.parametrize(
    ("version", "release"),
    [("0.34.0", (0, 34)), ("0.33.0+cpu", (0, 33)), ("0.34.1.dev3+gabc", (0, 34)), ("1.0", (1, 0)), ("dev", None)],
)
def test_a_vllm_version_string_reads_as_its_release(version: str, release: tuple[int, int] | None) -> None:
    assert vllm_release(version) == release


def test_the_installed_vllm_is_a_tested_release_and_the_start_up_line_names_both_versions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert VLLM_RELEASE in TESTED_VLLM_RELEASES
    logger = logging.getLogger("kvtriton.test_surface")
    with caplog.at_level(logging.INFO, logger=logger.name):
        check_vllm_release(logger, environ={})
    assert caplog.messages == [
        f"kvtriton {kvtriton.__version__} on vLLM {VLLM_VERSION} (tested on vLLM 0.33.x, 0.34.x)"
    ]


def test_an_untested_vllm_is_refused_with_one_line_unless_the_operator_insists(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(surface, "VLLM_RELEASE", (0, 35))
    monkeypatch.setattr(surface, "VLLM_VERSION", "0.35.0")
    logger = logging.getLogger("kvtriton.test_surface")
    with pytest.raises(RuntimeError) as refused:
        check_vllm_release(logger, environ={})
    message = str(refused.value)
    assert "\n" not in message
    assert "vLLM 0.35.0 is installed" in message and "0.33.x, 0.34.x" in message
    assert "pip install 'vllm>=0.33,<0.35'" in message and f"{ALLOW_UNTESTED_VLLM}=1" in message
    with caplog.at_level(logging.WARNING, logger=logger.name):
        check_vllm_release(logger, environ={ALLOW_UNTESTED_VLLM: "1"})
    assert [record.levelname for record in caplog.records] == ["WARNING"]
    assert "vLLM 0.35.0" in caplog.messages[0] and "starting anyway" in caplog.messages[0]


def test_the_release_facts_match_the_installed_vllm() -> None:
    """Each difference between 0.33 and 0.34 resolves the same way for the installed release."""
    newest = VLLM_RELEASE == (0, 34)
    assert surface.WORKER_GETS_DEVICE_POINTERS is newest
    assert surface.FAILED_TRANSFERS_ARE_REPORTED is newest
    assert surface.MANAGER_HAS_TOUCH is not newest
    assert surface.STORE_OFFERS_COUNT_ONCE_PER_REQUEST is newest
    assert surface.EVENTS_CARRY_REQ_CONTEXT is newest
    assert surface.PRIMARY_DEFERS_WRITE_RELEASE is newest
    assert surface.POLICY_MUST_FINISH_REQUESTS is newest
    assert surface.SECONDARY_TIERS_REFUSE_MULTI_NODE is newest
    assert surface.LOOKUPS_MARK_PRESENT is newest
