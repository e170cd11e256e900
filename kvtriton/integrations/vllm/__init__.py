"""Drop-in kvtriton backend for vLLM's OffloadingConnector (vLLM 0.33 and 0.34): the module vLLM loads by spec_module_path.

Switch vLLM's CPU offloading to kvtriton by configuration alone::

    vllm serve <model> --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {"spec_name": "KVTritonOffloadingSpec",
      "spec_module_path": "kvtriton.integrations.vllm", "cpu_bytes_to_use": 68719476736}}'

vLLM builds :class:`KVTritonOffloadingSpec` once in the scheduler process
(which asks it for the manager) and once per worker (which asks it for the
worker). The keys it reads are listed in :mod:`kvtriton.integrations.vllm._config`
and docs/vllm.md. vLLM is an optional dependency; the line that installs it is
:data:`kvtriton.integrations._vllm_release.VLLM_INSTALL`, which the errors below quote.

vLLM's spec factory takes the class with ``getattr(module, spec_name)``: a
name this module does not define is answered by :func:`_no_such_name`, which
names the spec closest to it and lists the specs.
"""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, NoReturn

from kvtriton.integrations._vllm_release import VLLM_INSTALL, installed_vllm_version, tested_releases

_EXTRA = VLLM_INSTALL


try:
    # vLLM itself first, to tell "absent" or "broken" from "too old" below.
    importlib.import_module("vllm")
except ImportError as _error:
    if _error.name == "vllm":
        raise ImportError(
            f"kvtriton.integrations.vllm needs vLLM, which is not installed; install a vLLM kvtriton is tested on: {_EXTRA}"
        ) from _error
    raise ImportError(
        f"vLLM {installed_vllm_version()} is installed but cannot be imported ({_error}); "
        f"install it with its dependencies: {_EXTRA}"
    ) from _error

try:
    from kvtriton.integrations.vllm._config import KVTritonOffloadConfig, compression_tag
    from kvtriton.integrations.vllm._encryption import ENCRYPTING_TIER_ATTRIBUTE, TierEncryption, spec_encryption
    from kvtriton.integrations.vllm._identity import KVIdentity, compute_identity, vllm_identity
    from kvtriton.integrations.vllm._integrity_report import IntegrityReport, integrity_metric_definitions
    from kvtriton.integrations.vllm._logging import attach_to_vllm_logging
    from kvtriton.integrations.vllm._manager import VLLMOffloadingManager
    from kvtriton.integrations.vllm._sealed_tiering import SealedTieringManager
    from kvtriton.integrations.vllm._single_tier_spec import KVTritonOffloadingSpec
    from kvtriton.integrations.vllm._spec_core import open_host_slab
    from kvtriton.integrations.vllm._surface import (
        JOB_RESULTS_DEFER_RELEASE,
        TIER_LABEL,
        AsyncLookupManager,
        BackpressureDetector,
        CacheHitSource,
        ConfigInfoMapping,
        JobId,
        JobResult,
        Locality,
        LookupResult,
        Medium,
        OffloadingConnectorStats,
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingMetricMetadata,
        OffloadingSpec,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
        RequestTenant,
        ScheduleEndContext,
        SecondaryTierManager,
        TransferJob,
        failed_load_result,
        get_offload_block_hash,
        get_offload_group_idx,
        mark_stored,
        request_tenant,
    )
    from kvtriton.integrations.vllm._tiered_spec import KVTritonTieringOffloadingSpec
    from kvtriton.integrations.vllm._worker import VLLMOffloadingWorker
except ImportError as _error:
    # A vLLM release without the offloading interface this adapter is written
    # against: say so instead of naming one missing module.
    if _error.name is not None and _error.name.startswith("vllm."):
        raise ImportError(
            f"kvtriton.integrations.vllm supports vLLM {tested_releases()}, but the installed vLLM "
            f"{installed_vllm_version()} lacks {_error.name} ({_error}); install a supported release with: {_EXTRA}"
        ) from _error
    raise

attach_to_vllm_logging()

__all__ = [
    # what a deployment names (spec_name) and what a user builds or reads
    "KVTritonOffloadConfig",
    "KVTritonOffloadingSpec",
    "KVTritonTieringOffloadingSpec",
    "VLLMOffloadingManager",
    "VLLMOffloadingWorker",
    "open_host_slab",
    # what kvtriton's own vLLM tiers (kvtriton.integrations.remote, .mooncake) and the tiering benchmark build
    # on: vLLM's tier interface as the surface module re-exports it (one place to follow a vLLM release), the
    # release's differences resolved there, and the engine identity, integrity report and sealed manager; each
    # is documented where it is defined; and the encryption per tenant a tier seals its chunks with
    "ENCRYPTING_TIER_ATTRIBUTE",
    "JOB_RESULTS_DEFER_RELEASE",
    "TIER_LABEL",
    "AsyncLookupManager",
    "BackpressureDetector",
    "CacheHitSource",
    "ConfigInfoMapping",
    "IntegrityReport",
    "JobId",
    "JobResult",
    "KVIdentity",
    "Locality",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadingConnectorStats",
    "OffloadingCounterMetadata",
    "OffloadingGaugeMetadata",
    "OffloadingMetricMetadata",
    "OffloadingSpec",
    "ReqContext",
    "RequestOffloadingContext",
    "RequestTenant",
    "ScheduleEndContext",
    "SealedTieringManager",
    "SecondaryTierManager",
    "TierEncryption",
    "TransferJob",
    "compression_tag",
    "compute_identity",
    "failed_load_result",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "integrity_metric_definitions",
    "mark_stored",
    "request_tenant",
    "spec_encryption",
    "vllm_identity",
]

_SPECS = {
    "KVTritonOffloadingSpec": "one host slab per rank",
    "KVTritonTieringOffloadingSpec": "host memory in front of secondary_tiers",
}
"""The classes ``kv_connector_extra_config['spec_name']`` may name here, with what each is."""


def _no_such_name(name: str) -> NoReturn:
    """The module's ``__getattr__``: a missing public name is taken for a mistyped ``spec_name`` (how vLLM reads
    it), answered with the closest spec in any case and the list; a private or dunder name gets Python's words."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    specs = ", ".join(f"{spec!r} ({what})" for spec, what in _SPECS.items())
    by_lower_name = {spec.lower(): spec for spec in _SPECS}
    close = difflib.get_close_matches(name.lower(), list(by_lower_name), n=1, cutoff=0.6)
    where = "kv_connector_extra_config['spec_name']"
    if close:
        meant = by_lower_name[close[0]]
        raise AttributeError(f"{__name__} has no spec {name!r}: did you mean {meant!r}? ({where}; the specs: {specs})")
    raise AttributeError(f"{__name__} has no spec {name!r}; {where} is one of the specs: {specs}")


if not TYPE_CHECKING:
    # Hidden from the type checker: a module-level __getattr__ would make every misspelt import of this module
    # type-check as a valid name.
    __getattr__ = _no_such_name
