"""The bad inputs a new user tried (issue 46): each gets one line naming the key, the value and what to do.

The fs tier's thread counts and ``locality``, a tier whose threads cannot all
start (the process stays usable), vLLM's own typed keys, a ``spec_name`` or
``spec_module_path`` typo as vLLM's spec factory meets it, and an empty
``cache_salt``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from tiering_fixtures.configs import tiering_config
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_fixtures.builders import salted_request

import kvtriton.integrations.vllm as vllm_integration
from kvtriton.integrations.vllm import KVTritonTieringOffloadingSpec
from kvtriton.integrations.vllm._config import (
    VLLM_BOOL_KEYS,
    VLLM_INT_KEYS,
    VLLM_KEYS,
    KVTritonOffloadConfig,
    check_keys,
)
from kvtriton.integrations.vllm._surface import FileSystemTierManager
from kvtriton.integrations.vllm._tier_configs import MAX_TIER_THREADS, THREAD_COUNT_KEYS

BUDGET: dict[str, object] = {"cpu_bytes_to_use": 1 << 20}


def fs_tier(root: Path, **keys: object) -> dict[str, object]:
    return {"type": "fs", "root_dir": str(root / "kv"), **keys}


def threads_since(before: set[threading.Thread]) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread not in before]


# --- the fs tier's thread counts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["n_read_threads", "n_write_threads"])
@pytest.mark.parametrize("value", [0, -1, MAX_TIER_THREADS + 1, 100_000])
def test_an_fs_thread_count_out_of_range_is_refused_at_start_naming_the_key_the_value_and_the_bound(
    key: str, value: int, tmp_path: Path
) -> None:
    tiers = [fs_tier(tmp_path, **{key: value})]
    message = (
        rf"^secondary_tiers\[0\] \(type 'fs'\) key '{key}' must be in 1\.\.{MAX_TIER_THREADS}, got {value}: "
        r"each is an I/O thread of the engine core"
    )
    with pytest.raises(ValueError, match=message):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))
    assert not (tmp_path / "kv").exists()


def test_every_thread_count_key_of_vllms_fs_tier_is_bounded() -> None:
    # A release that renames or adds one (vLLM 0.34 included) fails here, not silently unbounded.
    parameters = inspect.signature(FileSystemTierManager.__init__).parameters
    thread_keys = {name for name in parameters if "thread" in name}
    assert thread_keys and thread_keys <= THREAD_COUNT_KEYS


def test_the_bounds_themselves_are_accepted(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    tiers = [fs_tier(tmp_path, n_read_threads=1, n_write_threads=MAX_TIER_THREADS)]
    manager = KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers})).get_manager()
    try:
        assert len(threads_since(before)) >= 1 + MAX_TIER_THREADS
    finally:
        manager.shutdown()
    assert threads_since(before) == []


class ThreadStartsInTheFsTier:
    """Counts the threads vLLM's fs tier starts while it is built and, from the ``fail_at``-th, refuses them as a
    process at its thread limit does (``fail_at`` None: counts only)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int | None) -> None:
        self.started = 0
        building = threading.local()
        real_start = threading.Thread.start
        real_init = FileSystemTierManager.__init__

        def start(thread: threading.Thread) -> None:
            if getattr(building, "tier", False):
                self.started += 1
                if fail_at is not None and self.started >= fail_at:
                    raise RuntimeError("can't start new thread")
            real_start(thread)

        def init(tier: FileSystemTierManager, *args: Any, **kwargs: Any) -> None:
            building.tier = True
            try:
                real_init(tier, *args, **kwargs)
            finally:
                building.tier = False

        monkeypatch.setattr(threading.Thread, "start", start)
        monkeypatch.setattr(FileSystemTierManager, "__init__", init)


def fs_tier_thread_starts(tmp_path: Path) -> int:
    """How many threads an fs tier with 2 readers and 2 writers starts while it is built."""
    tiers = [fs_tier(tmp_path / "count", n_read_threads=2, n_write_threads=2)]
    spec = KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))
    with pytest.MonkeyPatch.context() as patched:
        counter = ThreadStartsInTheFsTier(patched, None)
        spec.get_manager().shutdown()
    return counter.started


@pytest.mark.parametrize("failing", ["third", "last"])
def test_a_tier_whose_threads_cannot_all_start_leaves_none_running_and_the_next_spec_works(
    failing: str, tmp_path: Path
) -> None:
    # 2 + 2 pool threads, then (vLLM 0.33) the tier's lookup thread: the third start fails inside the pool (two
    # left running), the last after it (the pool's threads left running, held by a tier never assigned); either way
    # they are stopped, and the next spec in the process starts its tier.
    starts = fs_tier_thread_starts(tmp_path)
    assert starts >= 4
    before = set(threading.enumerate())
    tiers = [fs_tier(tmp_path, n_read_threads=2, n_write_threads=2)]
    spec = KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))
    with pytest.MonkeyPatch.context() as patched:
        ThreadStartsInTheFsTier(patched, 3 if failing == "third" else starts)
        message = (
            r"^secondary_tiers\[0\] \(type 'fs'\): the engine core cannot start the tier's I/O threads \(can't start "
            r"new thread; n_read_threads=2, n_write_threads=2\); lower the tier's thread counts, or raise the "
            r"process's thread limit"
        )
        with pytest.raises(RuntimeError, match=message):
            spec.get_manager()
    assert threads_since(before) == []
    good = KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": [fs_tier(tmp_path / "next")]}))
    manager = good.get_manager()
    try:
        assert isinstance(manager, TieringOffloadingManager)
        assert len(threads_since(before)) >= 32  # vLLM's default: 16 readers and 16 writers
    finally:
        manager.shutdown()
    assert threads_since(before) == []


# --- locality ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["bogus", "local", ""])
def test_a_locality_vllm_does_not_know_is_refused_naming_the_key_and_the_choices(value: str, tmp_path: Path) -> None:
    tiers = [fs_tier(tmp_path, locality=value)]
    message = (
        rf"^secondary_tiers\[0\] \(type 'fs'\) key 'locality' must be one of \['LOCAL', 'REMOTE'\] \(upper case\) "
        rf"or null, got {re.escape(repr(value))}$"
    )
    with pytest.raises(ValueError, match=message):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))


@pytest.mark.parametrize("value", ["LOCAL", "REMOTE", None])
def test_a_locality_vllm_knows_is_accepted(value: str | None, tmp_path: Path) -> None:
    tiers = [fs_tier(tmp_path, locality=value)]
    KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))


# --- vLLM's typed keys -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("blocks_per_chunk", "x", r"an integer >= 1, got str 'x'"),
        ("blocks_per_chunk", 2.5, r"an integer >= 1, got float 2.5"),
        ("blocks_per_chunk", True, r"an integer >= 1, got bool True"),
        ("blocks_per_chunk", 0, r">= 1, got 0"),
        ("block_size", "16 tokens", r"an integer >= 1 tokens, got str '16 tokens'"),
        ("sync_load_budget_bytes", "lots", r"an integer >= 0 bytes, got str 'lots'"),
        ("sync_load_budget_bytes", -1, r">= 0 bytes, got -1"),
        ("store_threshold", "x", r"an integer >= 0, got str 'x'"),
        ("max_tracker_size", "many", r"an integer >= 1, got str 'many'"),
        ("kvtriton_num_programs", "x", r"an integer >= 1, got str 'x'"),
        ("kvtriton_summary_interval_s", "1m", r"an integer >= 0 seconds, got str '1m'"),
    ],
)
def test_an_int_key_given_what_is_no_integer_names_the_key_the_value_and_the_type(
    key: str, value: object, expected: str
) -> None:
    with pytest.raises(ValueError, match=rf"^kv_connector_extra_config\['{key}'\] must be {expected}$"):
        KVTritonOffloadConfig.from_extra_config({**BUDGET, key: value})


@pytest.mark.parametrize("key", sorted(VLLM_BOOL_KEYS))
@pytest.mark.parametrize("value", ["false", "true", 0, None])
def test_a_vllm_switch_given_anything_but_a_json_boolean_is_refused_saying_how_vllm_reads_it(
    key: str, value: object
) -> None:
    message = (
        rf"^kv_connector_extra_config\['{key}'\] must be true or false \(a JSON boolean: vLLM reads it with bool\(\), "
        rf"so any non-empty string, 'false' included, is true\), got {type(value).__name__} {re.escape(repr(value))}$"
    )
    with pytest.raises(ValueError, match=message):
        KVTritonOffloadConfig.from_extra_config({**BUDGET, key: value})


def test_vllms_typed_keys_given_as_vllm_reads_them_are_accepted() -> None:
    extra = {
        **BUDGET,
        "blocks_per_chunk": "4",
        "block_size": None,
        "sync_load_budget_bytes": 1 << 20,
        **dict.fromkeys(VLLM_BOOL_KEYS, False),
    }
    KVTritonOffloadConfig.from_extra_config(extra)
    assert set(VLLM_INT_KEYS) | VLLM_BOOL_KEYS <= VLLM_KEYS


def test_a_string_false_in_canonical_layout_is_named_before_the_spec_refuses_the_layout() -> None:
    # vLLM's bool("false") asked for the canonical layout; the user meant the opposite.
    with pytest.raises(ValueError, match=r"\['canonical_layout'\] must be true or false .*got str 'false'$"):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "canonical_layout": "false"}))


def test_an_unknown_key_is_refused_listing_the_valid_keys_in_the_message_itself() -> None:
    # A wheel install has no docs/: the error carries the list.
    with pytest.raises(ValueError) as raised:
        check_keys({**BUDGET, "blocks_per_chunks": 2}, tiered=False)
    message = str(raised.value)
    assert "docs/" not in message
    assert "'blocks_per_chunks' (did you mean 'blocks_per_chunk'?)" in message
    assert all(repr(key) in message for key in VLLM_KEYS | {"kvtriton_backend", "kvtriton_num_programs"})


# --- spec_name and spec_module_path, as vLLM's spec factory resolves them ----------------------------------------


def spec_cls(spec_name: str, spec_module_path: str) -> type:
    return OffloadingSpecFactory.get_spec_cls({"spec_name": spec_name, "spec_module_path": spec_module_path})


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("KVTritonOffloadSpec", "KVTritonOffloadingSpec"),
        ("KVTritonTieredOffloadingSpec", "KVTritonTieringOffloadingSpec"),
        ("kvtritonoffloadingspec", "KVTritonOffloadingSpec"),
    ],
)
def test_a_spec_name_typo_says_which_spec_was_meant_and_lists_the_specs(typo: str, meant: str) -> None:
    message = (
        rf"^kvtriton\.integrations\.vllm has no spec '{typo}': did you mean '{meant}'\? "
        r"\(kv_connector_extra_config\['spec_name'\]; the specs: 'KVTritonOffloadingSpec' \(one host slab per "
        r"rank\), 'KVTritonTieringOffloadingSpec' \(host memory in front of secondary_tiers\)\)$"
    )
    with pytest.raises(AttributeError, match=message):
        spec_cls(typo, "kvtriton.integrations.vllm")


def test_a_spec_name_like_no_spec_lists_the_specs() -> None:
    with pytest.raises(AttributeError, match=r"has no spec 'CPUSpec'; kv_connector_extra_config\['spec_name'\] is"):
        spec_cls("CPUSpec", "kvtriton.integrations.vllm")


def test_the_specs_still_resolve_and_other_missing_names_stay_plain_attribute_errors() -> None:
    assert spec_cls("KVTritonOffloadingSpec", "kvtriton.integrations.vllm") is vllm_integration.KVTritonOffloadingSpec
    assert getattr(vllm_integration, "__wrapped__", None) is None
    assert not hasattr(vllm_integration, "_private_name")
    dunder = "__path_x__"
    with pytest.raises(AttributeError, match=r"^module 'kvtriton.integrations.vllm' has no attribute '__path_x__'$"):
        getattr(vllm_integration, dunder)


@pytest.mark.parametrize(
    ("typo", "missing", "meant"),
    [
        ("kvtriton.integration.vllm", "kvtriton.integration", "kvtriton.integrations"),
        ("kvtriton.integrations.vllm_", "kvtriton.integrations.vllm_", "kvtriton.integrations.vllm"),
        ("kvtriton.integrations.vlm", "kvtriton.integrations.vlm", "kvtriton.integrations.vllm"),
        ("kvtriton.vllm", "kvtriton.vllm", "kvtriton.integrations.vllm"),
    ],
)
def test_a_spec_module_path_typo_under_kvtriton_says_which_module_was_meant(
    typo: str, missing: str, meant: str
) -> None:
    message = (
        rf"^No module named '{re.escape(missing)}'; did you mean '{re.escape(meant)}'\? \(kvtriton's spec_module_path "
        r"for vLLM is 'kvtriton\.integrations\.vllm'; a tier's module_path is 'kvtriton\.integrations\.mooncake'"
    )
    with pytest.raises(ModuleNotFoundError, match=message) as raised:
        spec_cls("KVTritonOffloadingSpec", typo)
    assert raised.value.name == missing
    assert missing not in sys.modules


def test_a_missing_module_outside_kvtriton_keeps_pythons_own_error() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'kvtriton_integrations'$"):
        importlib.import_module("kvtriton_integrations.vllm")


class VirtualModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A finder placed after kvtriton's that serves one ``kvtriton.*`` module no file defines."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname == self.name else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__dict__["served"] = True


@pytest.fixture
def virtual_module() -> Iterator[str]:
    name = "kvtriton.virtual_for_the_test"
    finder = VirtualModules(name)
    sys.meta_path.append(finder)
    try:
        yield name
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop(name, None)


def test_kvtritons_finder_comes_last_and_never_shadows_a_module_another_finder_serves(virtual_module: str) -> None:
    finders = [finder for finder in sys.meta_path if type(finder).__module__ == "kvtriton"]
    assert len(finders) == 1
    assert sys.meta_path.index(finders[0]) == len(sys.meta_path) - 2  # the test's finder was appended after it
    assert importlib.import_module(virtual_module).__dict__["served"] is True


def test_kvtritons_finder_is_not_asked_about_a_module_that_exists() -> None:
    # In a fresh process, so that the modules are imported for the first time.
    code = (
        "import sys, kvtriton\n"
        "(finder,) = [f for f in sys.meta_path if type(f).__module__ == 'kvtriton']\n"
        "asked = []\n"
        "finder.find_spec = lambda name, *rest: asked.append(name)\n"
        "import kvtriton.manager.policies, kvtriton.integrations.vllm._identity, kvtriton.sim\n"
        "try:\n"
        "    import no_such_module_anywhere\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error)\n"
        "print([name for name in asked if name.startswith('kvtriton')], 'no_such_module_anywhere' in asked)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # Asked only about what no finder before it found (the missing module, and the optional imports of the
    # libraries kvtriton imports), never about a kvtriton module, each of which exists.
    assert result.stdout.splitlines() == ["No module named 'no_such_module_anywhere'", "[] True"]


# --- an empty cache_salt (docs/security.md, "The tenant model") --------------------------------------------------


def salted_block_hashes(salt: str | None) -> list[bytes]:
    return [bytes(block_hash) for block_hash in salted_request(salt).block_hashes]


def test_an_empty_salt_hashes_as_no_salt_and_the_tenant_model_warns_about_it() -> None:
    # What docs/security.md warns a gateway about: "" shares the unsalted prefixes (every tier is keyed by these).
    unsalted = salted_block_hashes(None)
    assert salted_block_hashes("") == unsalted
    assert salted_block_hashes("tenant-a") != unsalted
    security = (Path(__file__).resolve().parents[3] / "docs" / "security.md").read_text(encoding="utf-8")
    tenant_model = security.split("## The tenant model", 1)[1].split("\n## ", 1)[0]
    assert "**An empty salt is no salt.**" in tenant_model
    assert "non-empty salt of its own" in tenant_model


@pytest.mark.parametrize("name", ["kvtriton._no_such_private_module", "kvtriton.integrations.vllm._confg"])
def test_a_missing_private_kvtriton_module_keeps_pythons_own_error(name: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=rf"^No module named '{re.escape(name)}'$"):
        importlib.import_module(name)
    assert importlib.util.find_spec("kvtriton._no_such_private_module") is None


def test_a_tier_module_path_typo_under_kvtriton_names_the_tier_and_the_module_meant() -> None:
    tiers = [{"type": "MooncakeStoreTier", "module_path": "kvtriton.integrations.mooncak"}]
    message = (
        r"^secondary_tiers\[0\] \(type 'MooncakeStoreTier'\): module_path 'kvtriton\.integrations\.mooncak' cannot be "
        r"imported \(No module named 'kvtriton\.integrations\.mooncak'; did you mean 'kvtriton\.integrations\.mooncake'\?"
    )
    with pytest.raises(ImportError, match=message):
        KVTritonTieringOffloadingSpec(tiering_config({**BUDGET, "secondary_tiers": tiers}))
