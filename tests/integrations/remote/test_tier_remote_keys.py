"""A backend states its keys once, in its configuration; vLLM's factory and kvtriton's start-up check read them.

Every remote tier's constructor signature is made from its configuration's
fields (``RemoteTier.config_type``), so kvtriton's check (``resolve_tier``,
which reads ``inspect.signature(tier_cls.__init__)``) names a missing,
unknown or wrongly typed key, and vLLM's ``SecondaryTierFactory`` builds the
tier from the entry's keys. The example backend of docs/tiers.md ("Adding a
tier backend") is loaded from the page and run through both.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from mooncake_fixtures.tiers import Primary, chunk_keys, resolve_lookups, run_job
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm_fixtures.builders import offloading_config

from kvtriton.integrations.mooncake import MooncakeStoreTier, MooncakeTierConfig
from kvtriton.integrations.remote import InMemoryStoreTier, InMemoryTierConfig, RemoteTier
from kvtriton.integrations.vllm._surface import FACTORY_ARGUMENTS
from kvtriton.integrations.vllm._tier_configs import resolve_tier

DOCS = Path(__file__).resolve().parents[3] / "docs" / "tiers.md"
DOCS_MODULE = "kvtriton_docs_dict_tier"
"""The module the docs' example backend is loaded as, so that vLLM's factory finds it by ``module_path``."""
CHUNK = 4096


def docs_backend_source() -> str:
    """The Python block of docs/tiers.md's "Adding a tier backend"."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## Adding a tier backend") :]
    section = section[: section.index("\n## ", 1)]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    return block


@pytest.fixture(scope="module")
def docs_backend() -> Iterator[types.ModuleType]:
    module = types.ModuleType(DOCS_MODULE)
    sys.modules[DOCS_MODULE] = module
    try:
        # dont_inherit: compiled as a user's module is, without this file's ``from __future__ import annotations``.
        code = compile(docs_backend_source(), str(DOCS), "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 -- the repository's own docs
        yield module
    finally:
        del sys.modules[DOCS_MODULE]


def constructor_keys(tier_cls: type[RemoteTier[Any]]) -> dict[str, object]:
    """The keys of the tier's configuration its constructor takes, with their defaults (``empty``: required)."""
    parameters = inspect.signature(tier_cls.__init__).parameters
    return {name: parameter.default for name, parameter in parameters.items() if name not in FACTORY_ARGUMENTS}


@pytest.mark.parametrize(
    ("tier_cls", "config_type"),
    [(MooncakeStoreTier, MooncakeTierConfig), (InMemoryStoreTier, InMemoryTierConfig)],
    ids=["mooncake", "in-memory"],
)
def test_a_backends_constructor_takes_exactly_its_configurations_keys_with_their_defaults(
    tier_cls: type[RemoteTier[Any]], config_type: type[Any]
) -> None:
    fields = {
        field.name: inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        for field in dataclasses.fields(config_type)
    }
    assert constructor_keys(tier_cls) == {**fields, "locality": None}
    assert tier_cls.config_type is config_type


@pytest.mark.parametrize(
    ("entry", "error", "message"),
    [
        (
            {"type": "MooncakeStoreTier", "module_path": "kvtriton.integrations.mooncake"},
            ValueError,
            "is missing the required key 'master_server_address' (MooncakeStoreTier needs it)",
        ),
        (
            {
                "type": "MooncakeStoreTier",
                "module_path": "kvtriton.integrations.mooncake",
                "master_server_address": "127.0.0.1:1",
                "tiemout_s": 5,
            },
            ValueError,
            "has unknown key 'tiemout_s'",
        ),
        (
            {"type": "InMemoryStoreTier", "module_path": "kvtriton.integrations.remote", "io_threads": "4"},
            TypeError,
            "key 'io_threads' must be an integer, got str '4'",
        ),
        (
            {"type": "DictStoreTier", "module_path": DOCS_MODULE, "tabel": "t"},
            ValueError,
            "has unknown key 'tabel'; DictStoreTier takes [",
        ),
        (
            {"type": "DictStoreTier", "module_path": DOCS_MODULE, "table": 3},
            TypeError,
            "key 'table' must be a string, got int 3",
        ),
    ],
    ids=["missing", "unknown", "type", "docs-unknown", "docs-type"],
)
def test_kvtritons_start_up_check_names_a_bad_key_from_the_configuration_alone(
    docs_backend: types.ModuleType, entry: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        resolve_tier(0, entry)


def test_the_docs_example_backend_is_built_by_vllms_factory_and_round_trips_a_chunk(
    docs_backend: types.ModuleType,
) -> None:
    entry: dict[str, object] = {"type": "DictStoreTier", "module_path": DOCS_MODULE, "table": "docs", "timeout_s": 5}
    assert resolve_tier(0, entry).__name__ == "DictStoreTier"
    primary = Primary(2, CHUNK)
    spec = CPUOffloadingSpec(offloading_config({"cpu_bytes_to_use": primary.rows.nbytes}))
    tier = cast("RemoteTier[Any]", SecondaryTierFactory.create_secondary_tier(dict(entry), primary.view, spec))  # pyright: ignore[reportUnknownMemberType] -- vLLM types the entry as a bare dict
    try:
        assert tier.wait_until_up(10.0), "the docs' backend never came up"
        assert tier.config.timeout_s == 5
        assert tier.config.table == "docs"
        keys = chunk_keys(1, salt=5)
        (written,) = primary.fill([0], seed=5)
        assert run_job(tier, keys, [0], load=False).success
        assert resolve_lookups(tier, keys) == [LookupResult.HIT]
        assert run_job(tier, keys, [1], load=True).success
        assert primary.chunk(1) == written
        stored = cast("dict[str, dict[str, bytes]]", docs_backend.TABLES)["docs"]
        assert tier.object_key(keys[0]) in stored
    finally:
        tier.shutdown()
