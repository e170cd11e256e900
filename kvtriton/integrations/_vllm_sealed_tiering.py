"""vLLM's tiering orchestrator behind kvtriton's tiered spec: every chunk a secondary tier gets is sealed, every chunk it returns verified.

:class:`SealedTieringManager` is vLLM 0.33's ``TieringOffloadingManager``
with the identity of the engine's chunks (``spec.identity``) published on the
primary tier's ``vllm:kv_offload_config_info`` series.

Import it through :mod:`kvtriton.integrations.vllm`, which checks that vLLM
is installed.
"""

from __future__ import annotations

from collections.abc import Sequence

from typing_extensions import override
from vllm.v1.kv_offload import base as vllm_base
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

from kvtriton.integrations._vllm_identity import KVIdentity

__all__ = ["IDENTITY_INFO_KEYS", "SealedTieringManager"]

IDENTITY_INFO_KEYS = ("kvtriton_identity", "kvtriton_identity_source")
"""The labels the primary tier's ``vllm:kv_offload_config_info`` series gains: the fingerprint and its source."""


class SealedTieringManager(TieringOffloadingManager):
    """vLLM's ``TieringOffloadingManager`` for chunks of one identity (see the module docstring)."""

    def __init__(
        self,
        primary_tier: CPUPrimaryTierOffloadingManager,
        secondary_tiers: list[SecondaryTierManager],
        *,
        identity: KVIdentity,
        tier_poll_interval_s: float,
    ) -> None:
        super().__init__(primary_tier, secondary_tiers, tier_poll_interval_s)
        self.identity = identity
        """What every chunk's seal names; shown on the primary's config info series."""

    @override
    def config_info(self) -> Sequence[vllm_base.ConfigInfoMapping]:
        primary, *tiers = super().config_info()
        labels = {"kvtriton_identity": self.identity.hex, "kvtriton_identity_source": self.identity.source}
        return [{**primary, **labels}, *tiers]
