"""Cache policies by name: the one place a new policy is registered."""

from __future__ import annotations

from collections.abc import Callable

from kvtriton.manager.policies._arc import ARCCachePolicy
from kvtriton.manager.policies._base import CachePolicy
from kvtriton.manager.policies._lru import LRUCachePolicy

PolicyFactory = Callable[[int], CachePolicy]
"""Builds a policy for a cache of the given capacity (in blocks)."""

POLICIES: dict[str, PolicyFactory] = {
    "lru": LRUCachePolicy,
    "arc": ARCCachePolicy,
}
"""Every known policy. Add a line here to make a new policy selectable by name."""


def policy_names() -> list[str]:
    """The valid ``cache_policy`` names, sorted."""
    return sorted(POLICIES)


def canonical_policy_name(name: str) -> str:
    """``name`` as the registry spells it (names are case-insensitive, as vLLM's config and ``--policies`` take them).

    Raises ``TypeError`` for a non-string and ``ValueError`` listing the
    valid names when ``name`` is unknown.
    """
    if not isinstance(name, str):  # pyright: ignore[reportUnnecessaryIsInstance] -- config values arrive untyped
        raise TypeError(f"cache_policy must be a string, got {type(name).__name__}: {name!r}")
    canonical = name.strip().lower()
    if canonical not in POLICIES:
        raise ValueError(f"cache_policy must be one of {policy_names()}, got {name!r}")
    return canonical


def make_policy(name: str, capacity: int) -> CachePolicy:
    """Build the policy called ``name`` (any case) for ``capacity`` blocks.

    Raises ``ValueError`` listing the valid names when ``name`` is unknown.
    """
    return POLICIES[canonical_policy_name(name)](capacity)
