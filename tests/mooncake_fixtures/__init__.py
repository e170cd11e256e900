"""A real Mooncake Store on the loopback for the tier's tests (kvtriton/integrations/_mooncake_local.py starts it).

Tests that break the store (kill, hang or restart the master, kill the holder)
get their own :class:`MooncakeCluster`. :data:`MOONCAKE_MISSING` is the reason
to skip when the package is not installed; an installed package that cannot run
(a missing system library) fails the tests instead of skipping them.
"""

from __future__ import annotations

import os

from kvtriton.integrations._mooncake_local import LOOPBACK, MooncakeCluster, mooncake_missing

__all__ = ["LOOPBACK", "MOONCAKE_MISSING", "MooncakeCluster"]

# Without it the store client advertises (and its peers connect to) the machine's external address.
os.environ["MC_TCP_BIND_ADDRESS"] = LOOPBACK

MOONCAKE_MISSING: str | None = mooncake_missing()
