"""The fixtures the Mooncake tier's tests share, found by pytest by name (test modules import only the
:class:`NewTier` type, for their annotations).

A Mooncake cluster (master and storage holder on the loopback) starts once per test module (``cluster``) or
once per test for a test that kills, hangs or restarts it (``own_cluster``); the tiers and the plain client a
test opens go with the cluster they talk to.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import pytest

if TYPE_CHECKING:
    from mooncake_fixtures.tiers import Primary

    from kvtriton.integrations._mooncake_local import MooncakeCluster
    from kvtriton.integrations.mooncake import MooncakeStoreTier, StoreClient


class NewTier(Protocol):
    """The ``new_tier`` fixture's type, for the tests that take it (imported under ``TYPE_CHECKING``)."""

    def __call__(self, memory: Primary, namespace: str, *, dtype_override: str | None = None) -> MooncakeStoreTier: ...


if importlib.util.find_spec("vllm") is not None:
    # These import vLLM; without it the folder's modules skip themselves (pytest.importorskip) and
    # test_tier_mooncake_install.py, which never imports it, still runs.
    from mooncake_fixtures.managers import cluster as cluster
    from mooncake_fixtures.managers import own_cluster as own_cluster
    from mooncake_fixtures.tiers import make_tier
    from tiering_fixtures.configs import managers as managers

    from kvtriton.integrations.mooncake import open_store
    from kvtriton.integrations.mooncake._config import MooncakeTierConfig

    @pytest.fixture(scope="module")
    def store(cluster: MooncakeCluster) -> Iterator[StoreClient]:
        """A plain client of the module's cluster: what a broken or foreign writer (or a reader of raw keys) uses."""
        client = open_store(MooncakeTierConfig(master_server_address=cluster.master_address))
        assert client is not None
        yield client
        client.close()

    @pytest.fixture
    def tier_entry(cluster: MooncakeCluster) -> Callable[[str], dict[str, object]]:
        """``tier_entry(namespace)``: the ``secondary_tiers`` entry that has vLLM's factory load the Mooncake tier
        by module path, on the module's cluster."""

        def entry(namespace: str) -> dict[str, object]:
            return {
                "type": "MooncakeStoreTier",
                "module_path": "kvtriton.integrations.mooncake",
                "master_server_address": cluster.master_address,
                "namespace": namespace,
                "timeout_s": 5.0,
            }

        return entry

    @pytest.fixture
    def new_tier(cluster: MooncakeCluster, tiers: list[MooncakeStoreTier]) -> NewTier:
        """``new_tier(memory, namespace, dtype_override=None)``: ``make_tier`` on the module's cluster, the tier kept
        in ``tiers`` to be shut down with the module."""

        def new(memory: Primary, namespace: str, *, dtype_override: str | None = None) -> MooncakeStoreTier:
            tier = make_tier(cluster.master_address, memory, namespace=namespace, dtype_override=dtype_override)
            tiers.append(tier)
            return tier

        return new


def _shut_down_together(made: list[MooncakeStoreTier]) -> None:
    """Closing a Mooncake client takes a second; closing them side by side keeps that out of every test."""
    closers = [threading.Thread(target=tier.shutdown) for tier in made]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join()


@pytest.fixture(scope="module")
def tiers() -> Iterator[list[MooncakeStoreTier]]:
    """Every tier the module's tests build on ``cluster`` (each its own namespace), shut down at the module's end."""
    made: list[MooncakeStoreTier] = []
    yield made
    _shut_down_together(made)


@pytest.fixture
def own_tiers() -> Iterator[list[MooncakeStoreTier]]:
    """The tiers of one test, shut down at its end: with ``own_cluster`` (or a cluster the test starts itself),
    whose broken store goes with the test."""
    made: list[MooncakeStoreTier] = []
    yield made
    _shut_down_together(made)
