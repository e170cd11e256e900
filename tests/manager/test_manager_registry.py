"""The policy registry: names, errors, and adding a policy with one line."""

from __future__ import annotations

import re

import pytest

from kvtriton._keys import make_offload_key
from kvtriton._offload_types import ReqContext
from kvtriton.manager import (
    POLICIES,
    ARCCachePolicy,
    CPUOffloadingManager,
    LRUCachePolicy,
    make_policy,
    policy_names,
)
from kvtriton.manager.policies import CachePolicy
from tests.manager.conftest import NewestFirst


def test_registry_builds_each_policy_by_name() -> None:
    assert isinstance(make_policy("lru", 4), LRUCachePolicy)
    assert isinstance(make_policy("arc", 4), ARCCachePolicy)


def test_registry_rejects_an_unknown_name_listing_the_valid_ones() -> None:
    with pytest.raises(
        ValueError, match=rf"cache_policy must be one of {re.escape(str(policy_names()))}, got 'nosuch'"
    ):
        make_policy("nosuch", 4)


def test_a_registered_policy_is_selectable_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    factory: type[CachePolicy] = NewestFirst
    monkeypatch.setitem(POLICIES, "newest", factory)
    manager = CPUOffloadingManager(2, cache_policy="newest")
    ctx = ReqContext()
    keys = [make_offload_key(bytes([i])) for i in range(3)]
    for key in keys:
        out = manager.prepare_store([key], ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
    assert manager.slot_map() == {keys[0]: 0, keys[2]: 1}


@pytest.mark.parametrize("name", ["LRU", "Arc", " lru "])
def test_policy_names_are_case_insensitive_as_in_vllms_config(name: str) -> None:
    manager = CPUOffloadingManager(2, cache_policy=name)
    assert manager.cache_policy == name.strip().lower()


def test_a_policy_name_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(TypeError, match="cache_policy must be a string, got int: 3"):
        CPUOffloadingManager(2, cache_policy=3)  # pyright: ignore[reportArgumentType] -- the wrong type is the point
