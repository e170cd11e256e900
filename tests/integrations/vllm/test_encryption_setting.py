"""``kvtriton_encryption`` in the tiered spec: the setting, every refusal at start-up, the tenant hook, the line.

Each refusal is one line naming the key, the value and what to do; a tier
that would store chunks in the clear (one that reads host memory itself, as
vLLM's obj and p2p tiers do) is refused with the tier named, while vLLM's fs
tier is built over the egress area; the master key is read at start-up (a
key file others may read stops the start); the connector's contexts carry
each request's tenant once the spec is built.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")
pytest.importorskip("cryptography", reason="encryption needs kvtriton's [encryption] extra")

from tiering_fixtures.configs import tiering_config
from vllm_fixtures.builders import salted_request

from kvtriton.encryption import MasterKey, MasterKeyError
from kvtriton.integrations.vllm import KVTritonTieringOffloadingSpec, RequestTenant, TierEncryption, request_tenant
from kvtriton.integrations.vllm._encryption import EncryptionSetting, refuse_plaintext_tiers, spec_encryption
from kvtriton.integrations.vllm._surface import (
    REQ_CONTEXT_FACTORY,
    REQ_CONTEXT_FACTORY_MODULE,
    FileSystemTierManager,
    install_tenant_hook,
)

KEY_HEX = bytes(range(32)).hex()
MEMORY_TIER: dict[str, object] = {
    "type": "InMemoryStoreTier",
    "module_path": "kvtriton.integrations.remote",
    "store": "setting-test",
}
BUDGET: dict[str, object] = {"cpu_bytes_to_use": 1 << 20}


def key_file(folder: Path, mode: int = 0o600) -> Path:
    path = folder / "master.key"
    path.write_text(KEY_HEX + "\n")
    path.chmod(mode)
    return path


def spec_with(setting: object, tiers: list[dict[str, object]] | None = None) -> KVTritonTieringOffloadingSpec:
    extra: dict[str, object] = {**BUDGET, "secondary_tiers": tiers or [MEMORY_TIER], "kvtriton_encryption": setting}
    return KVTritonTieringOffloadingSpec(tiering_config(extra))


# --- the setting -------------------------------------------------------------------------------------------------


def test_no_setting_is_encryption_off() -> None:
    assert EncryptionSetting.from_extra_config({}) is None
    assert EncryptionSetting.from_extra_config({"kvtriton_encryption": None}) is None


def test_a_key_file_or_a_variable_with_retired_ids_parses() -> None:
    retired = "0123456789abcdef"
    parsed = EncryptionSetting.from_extra_config(
        {"kvtriton_encryption": {"master_key_file": "/k", "retired_key_ids": [retired]}}
    )
    assert parsed == EncryptionSetting(master_key_file="/k", retired_key_ids=(retired,))
    assert EncryptionSetting.from_extra_config({"kvtriton_encryption": {"master_key_env": " KEY "}}) == (
        EncryptionSetting(master_key_env="KEY")
    )


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("/etc/key", r"must be an object such as .*got str '/etc/key'"),
        ({}, r"exactly one of 'master_key_file' and 'master_key_env', got neither"),
        (
            {"master_key_file": "/a", "master_key_env": "B"},
            r"exactly one .*got \['master_key_file', 'master_key_env'\]",
        ),
        ({"master_key_file": ""}, r"\['master_key_file'\] must be a non-empty string, got str ''"),
        ({"master_key_env": 7}, r"\['master_key_env'\] must be a non-empty string, got int 7"),
        ({"master_key_file": "/a", "key": "x"}, r"unknown key\(s\) \['key'\]"),
        ({"master_key_file": "/a", "retired_key_ids": "abc"}, r"\['retired_key_ids'\] must be a list of key ids"),
        ({"master_key_file": "/a", "retired_key_ids": ["xyz"]}, r"\['retired_key_ids'\]\[0\]"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_key_and_the_value(setting: object, message: str) -> None:
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\['kvtriton_encryption'\]" + f".*{message}"):
        EncryptionSetting.from_extra_config({"kvtriton_encryption": setting})


def test_the_current_key_cannot_also_be_retired() -> None:
    master = MasterKey(bytes(range(32)), source="test")
    with pytest.raises(ValueError, match=f"lists {master.key_id}, the id of the current master key"):
        TierEncryption(master, [master.key_id])


def test_the_encryption_s_words_name_the_key_id_and_never_the_key() -> None:
    master = MasterKey(bytes(range(32)), source="file '/k'")
    encryption = TierEncryption(master, ["0123456789abcdef"])
    for words in (encryption.describe(), repr(encryption), str(encryption)):
        assert KEY_HEX not in words and bytes(range(32)).hex().upper() not in words
    assert master.key_id in encryption.describe() and "0123456789abcdef" in encryption.describe()


def test_boxes_are_one_per_tenant_and_model() -> None:
    encryption = TierEncryption(MasterKey(bytes(range(32)), source="test"))
    alice = encryption.box(RequestTenant("alice"), b"m" * 16)
    assert encryption.box(RequestTenant("alice"), b"m" * 16) is alice
    assert encryption.box(RequestTenant(None), b"m" * 16) is not alice
    assert encryption.box(RequestTenant("alice"), b"n" * 16) is not alice
    sealed = alice.seal(b"kv" * 100, b"ad")
    assert isinstance(encryption.box(RequestTenant("bob"), b"m" * 16).open(sealed, b"ad"), str)  # a failure


# --- the spec ----------------------------------------------------------------------------------------------------


def test_the_spec_loads_the_key_from_a_private_file_and_hands_it_to_its_tiers(tmp_path: Path) -> None:
    spec = spec_with({"master_key_file": str(key_file(tmp_path))})
    assert spec.encryption is not None and spec.encryption.key_id == MasterKey(bytes(range(32)), source="").key_id
    assert spec_encryption(spec.tier_facing_spec()) is spec.encryption


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_a_key_file_others_may_read_stops_the_start_naming_the_file_and_its_mode(tmp_path: Path, mode: int) -> None:
    path = key_file(tmp_path, mode)
    with pytest.raises(MasterKeyError, match=f"master key file '{path}' has mode {mode:04o}.*chmod 600"):
        spec_with({"master_key_file": str(path)})


def test_a_key_in_an_unset_variable_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTRITON_TEST_MASTER_KEY", raising=False)
    with pytest.raises(MasterKeyError, match="environment variable KVTRITON_TEST_MASTER_KEY .* is not set"):
        spec_with({"master_key_env": "KVTRITON_TEST_MASTER_KEY"})
    monkeypatch.setenv("KVTRITON_TEST_MASTER_KEY", KEY_HEX)
    assert spec_with({"master_key_env": "KVTRITON_TEST_MASTER_KEY"}).encryption is not None


def test_a_tier_that_reads_host_memory_itself_is_refused_with_one_line_naming_it_and_what_to_use(
    tmp_path: Path,
) -> None:
    tiers: list[dict[str, object]] = [
        MEMORY_TIER,
        {"type": "fs", "root_dir": str(tmp_path / "kv")},
        {"type": "DeferringTier", "module_path": "tiering_fixtures.deferring_tier"},
    ]
    with pytest.raises(ValueError) as refused:
        spec_with({"master_key_file": str(key_file(tmp_path))}, tiers)
    message = str(refused.value)
    assert "\n" not in message
    assert "secondary_tiers[2] (type 'DeferringTier')" in message and "DeferringTier)" in message
    assert "vLLM's fs tier" in message and "MooncakeStoreTier" in message and "remove kvtriton_encryption" in message
    assert not (tmp_path / "kv").exists()


def test_vllm_s_fs_tier_is_accepted_and_built_over_the_egress_area(tmp_path: Path) -> None:
    tiers: list[dict[str, object]] = [{"type": "fs", "root_dir": str(tmp_path / "kv")}]
    spec = spec_with({"master_key_file": str(key_file(tmp_path))}, tiers)
    manager = spec.get_manager()
    try:
        (tier,) = cast("Any", manager).secondary_tiers
        assert isinstance(tier, FileSystemTierManager)
        # The tier's only memory is the egress area, never the primary's region (whose chunks it could read).
        assert tier._primary_kv_view.obj is not cast("Any", manager).primary_tier.get_kv_memoryview().obj  # pyright: ignore[reportPrivateUsage] -- the view vLLM's fs tier copies through
    finally:
        manager.shutdown()


def test_refusal_covers_any_class_without_the_attribute() -> None:
    class SealsTier:
        kvtriton_seals_per_tenant = True

    class FsSubclass(FileSystemTierManager):
        """A subclass may move the bytes otherwise: only vLLM's own fs tier is built over the egress area."""

    refuse_plaintext_tiers([("a", SealsTier), ("b", FileSystemTierManager)])
    with pytest.raises(ValueError, match=r"but b \(dict\) reads"):
        refuse_plaintext_tiers([("a", SealsTier), ("b", dict)])
    with pytest.raises(ValueError, match=r"but c \(.*FsSubclass\) reads"):
        refuse_plaintext_tiers([("c", FsSubclass)])


def test_the_single_tier_spec_only_warns_about_the_setting(caplog: pytest.LogCaptureFixture) -> None:
    from kvtriton.integrations.vllm._config import check_keys

    with caplog.at_level(logging.WARNING):
        assert check_keys({"kvtriton_encryption": {"master_key_env": "X"}}, tiered=False) == ["kvtriton_encryption"]


def test_the_manager_s_start_up_line_says_encryption_is_on_and_the_key_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = spec_with({"master_key_file": str(key_file(tmp_path))})
    with caplog.at_level(logging.INFO, logger="kvtriton"):
        manager = spec.get_manager()
    try:
        assert spec.encryption is not None
        lines = [record.getMessage() for record in caplog.records if "encryption on" in record.getMessage()]
        assert len(lines) == 1 and spec.encryption.key_id in lines[0] and KEY_HEX not in caplog.text
    finally:
        manager.shutdown()


# --- the tenant hook ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("salt", "tenant"), [("alice", "alice"), (None, None), ("", None)])
def test_the_hook_records_each_request_s_tenant_on_the_context_the_connector_builds(
    monkeypatch: pytest.MonkeyPatch, salt: str | None, tenant: str | None
) -> None:
    module = importlib.import_module(REQ_CONTEXT_FACTORY_MODULE)
    monkeypatch.setattr(module, REQ_CONTEXT_FACTORY, getattr(module, REQ_CONTEXT_FACTORY))  # undone after the test
    install_tenant_hook()
    install_tenant_hook()  # a second spec in the process changes nothing
    factory: Any = getattr(module, REQ_CONTEXT_FACTORY)
    assert not getattr(factory.__wrapped__, "kvtriton_tenant_hook", False)  # wrapped once
    arguments: list[object] = [salted_request(salt)]
    if len(inspect.signature(factory.__wrapped__).parameters) > 1:
        arguments.append(object())  # vLLM 0.34 passes its scheduler too
    context = factory(*arguments)
    assert request_tenant(context) == RequestTenant(tenant)


def test_a_context_built_without_the_hook_names_no_tenant() -> None:
    from vllm.v1.kv_offload.base import ReqContext

    assert request_tenant(ReqContext(req_id="peer")) is None
