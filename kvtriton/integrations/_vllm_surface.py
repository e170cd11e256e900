"""Every vLLM name kvtriton relies on that vLLM does not promise to keep: the inventory, and the way to reach each.

vLLM's offloading interface moves between releases, and kvtriton's adapters
lean on a few of its internals: a private registry, a private hook it
overrides, attributes its orchestrator reads, a factory's assertion, the
field its secondary tiers name their storage after. They are all listed in
:data:`VLLM_PRIVATE_NAMES` (what, where kvtriton uses it, why), and the code
reaches the ones it reads through the helpers below, so a vLLM release that
changes one is one edit here. ``tests/integrations/test_vllm_private_names.py``
checks each entry against the installed vLLM and fails naming the entry.

Import it through :mod:`kvtriton.integrations.vllm`, which checks that vLLM
is installed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory


@dataclass(frozen=True, slots=True)
class VLLMPrivateName:
    """One vLLM name kvtriton relies on outside vLLM's public interface."""

    key: str
    """A short name for the entry (the test checks each key once)."""
    name: str
    """The dotted vLLM name (``module.Class.attribute``), or what kvtriton relies on when it is no single name."""
    used_by: str
    """The kvtriton module that relies on it."""
    why: str
    """Why kvtriton needs it, and what it would break."""


RESTATED_TIERING_SPEC_ATTRIBUTES: tuple[str, ...] = (
    "num_chunks",
    "kv_bytes_per_chunk",
    "cpu_page_size_per_worker",
    "cpu_info",
    "replicated_layout",
    "secondary_tier_configs",
    "tier_poll_interval_s",
    "_manager",
)
"""Attributes vLLM's ``TieringOffloadingSpec`` (and its ``CPUOffloadingSpec`` parent) set, which kvtriton's tiered
spec restates or reads."""

TIER_CLASS_REFUSED: type[Exception] = AssertionError
"""What ``SecondaryTierFactory.get_tier_class`` raises for a ``module_path`` class that is no ``SecondaryTierManager``."""

FACTORY_ARGUMENTS = frozenset({"self", "offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector"})
"""A tier constructor's parameters vLLM's ``SecondaryTierFactory`` fills itself (not keys of the tier's config)."""

FACTORY_KEYS = frozenset({"type", "module_path", "backpressure"})
"""Keys of a tier's config vLLM's ``SecondaryTierFactory`` consumes before calling the constructor."""


VLLM_PRIVATE_NAMES: tuple[VLLMPrivateName, ...] = (
    VLLMPrivateName(
        "policy_registry",
        "vllm.v1.kv_offload.cpu.policies.factory.CachePolicyFactory._registry",
        "kvtriton.integrations._vllm_config",
        "the names of vLLM's registered eviction policies (no public list): a policy name kvtriton leaves to vLLM "
        "is refused at start-up unless vLLM resolves it",
    ),
    VLLMPrivateName(
        "secondary_tiers_hook",
        "vllm.v1.kv_offload.tiering.spec.TieringOffloadingSpec._get_secondary_tiers",
        "kvtriton.integrations._vllm_tiering",
        "overridden, so that a bad secondary_tiers entry (missing package, unknown key, wrong class) is one line "
        "naming the tier instead of vLLM's bare error",
    ),
    VLLMPrivateName(
        "primary_num_chunks",
        "vllm.v1.kv_offload.tiering.manager.TieringOffloadingManager reads primary_tier._num_chunks",
        "kvtriton.integrations._vllm_tiering",
        "KVTritonPrimaryTier sets _num_chunks: the orchestrator sizes its occupancy metrics from it",
    ),
    VLLMPrivateName(
        "restated_spec_attributes",
        "vllm.v1.kv_offload.tiering.spec.TieringOffloadingSpec attributes "
        + ", ".join(RESTATED_TIERING_SPEC_ATTRIBUTES),
        "kvtriton.integrations._vllm_tiering",
        "set by vLLM's parents from vLLM's own region layout; kvtriton's spec restates them for its own layout "
        "(RESTATED_TIERING_SPEC_ATTRIBUTES), and vLLM's tiers and metrics read them",
    ),
    VLLMPrivateName(
        "tier_class_assertion",
        "vllm.v1.kv_offload.tiering.factory.SecondaryTierFactory.get_tier_class raises AssertionError",
        "kvtriton.integrations._vllm_tiering",
        "vLLM asserts that an out-of-tree tier class is a SecondaryTierManager: kvtriton catches it "
        "(TIER_CLASS_REFUSED) to name the tier",
    ),
    VLLMPrivateName(
        "tier_factory_arguments",
        "vllm.v1.kv_offload.tiering.factory.SecondaryTierFactory.create_secondary_tier arguments and keys",
        "kvtriton.integrations._vllm_tiering",
        "the constructor arguments the factory fills itself (FACTORY_ARGUMENTS) and the tier keys it consumes "
        "(FACTORY_KEYS): kvtriton checks the rest of a tier's keys against the tier's constructor",
    ),
    VLLMPrivateName(
        "model_name_namespace",
        "vllm.v1.kv_offload.file_mapper.FileMapper names storage after config.model.name",
        "kvtriton.integrations._vllm_tiering",
        "kvtriton rewrites the model name the secondary tiers see (with_model_name) to give its own chunk bytes "
        "a namespace of their own",
    ),
    VLLMPrivateName(
        "primary_region_methods",
        "vllm.v1.kv_offload.tiering.manager.CPUPrimaryTierOffloadingManager reads mmap_region "
        "create_kv_memoryview and cleanup",
        "kvtriton.integrations._vllm_tiering",
        "vLLM's own primary runs over kvtriton's shared region (a vLLM eviction policy), seen through an object "
        "with only these two methods",
    ),
    VLLMPrivateName(
        "promotion_hooks",
        "vllm.v1.kv_offload.tiering.manager.TieringOffloadingManager._complete_promotion(job_metadata, "
        "completed_job) and _initiate_promotion(tier_idx, key, req_context) -> bool",
        "kvtriton.integrations._vllm_sealed_tiering",
        "overridden: a promoted chunk is verified before vLLM marks its slot ready (a faulty key leaves the job's "
        "successful_keys), and a key that failed is not promoted from that tier again (False: a miss)",
    ),
    VLLMPrivateName(
        "fs_file_mapper",
        "vllm.v1.kv_offload.tiering.fs.manager.FileSystemTierManager.file_mapper",
        "kvtriton.integrations._vllm_sealed_tiering",
        "the file of a chunk that failed its seal check is removed (as vLLM's fs tier removes one cut short), so "
        "the next cascade writes it afresh instead of skipping a file that exists",
    ),
)
"""The inventory, one entry per name; the test checks each against the installed vLLM."""


def registered_cache_policies() -> list[str]:
    """The eviction policy names vLLM's ``CachePolicyFactory`` has registered, sorted (vLLM has no public list)."""
    return sorted(CachePolicyFactory._registry)  # pyright: ignore[reportPrivateUsage] -- the inventory's first entry


def with_model_name(config: OffloadingConfig, name: str) -> OffloadingConfig:
    """``config`` with another model name: the name vLLM's ``FileMapper`` (and the other tiers) file chunks under."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, name=name))
