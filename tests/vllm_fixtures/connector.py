"""A worker's transfer calls made as the installed vLLM's OffloadingConnector makes them.

vLLM 0.33's connector hands ``submit_store``/``submit_load`` the request's
``GPULoadStoreSpec`` of block ids; vLLM 0.34's first resolves it against the
registered KV caches (``resolve_device_pointers``: one device address per
block and data reference) and hands over the ``DevicePointers``. Tests that
drive a worker through these helpers run on either contract, whichever vLLM
is installed, the way a real engine would call it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker

from kvtriton.integrations.vllm._surface import WORKER_GETS_DEVICE_POINTERS


def device_side(spec: GPULoadStoreSpec, kv_caches: CanonicalKVCaches) -> object:
    """What the installed vLLM's connector passes for ``spec``: the spec itself (0.33) or its resolved pointers."""
    if not WORKER_GETS_DEVICE_POINTERS:
        return spec
    # Imported by name: the module is new in vLLM 0.34, and this file type-checks against either release.
    resolve = cast(
        "Callable[[GPULoadStoreSpec, CanonicalKVCaches], object]",
        importlib.import_module("vllm.v1.kv_offload.pointer_utils").resolve_device_pointers,
    )
    return resolve(spec, kv_caches)


def submit_store(
    worker: OffloadingWorker, kv_caches: CanonicalKVCaches, job_id: int, spec: GPULoadStoreSpec, slots: LoadStoreSpec
) -> bool:
    """``worker.submit_store`` as the connector calls it (positionally, the device side as the release passes it)."""
    store = cast("Callable[[int, object, LoadStoreSpec], bool]", worker.submit_store)
    return store(job_id, device_side(spec, kv_caches), slots)


def submit_load(
    worker: OffloadingWorker,
    kv_caches: CanonicalKVCaches,
    job_id: int,
    slots: LoadStoreSpec,
    spec: GPULoadStoreSpec,
    *,
    expedited: bool = False,
) -> bool:
    """``worker.submit_load`` as the connector calls it; ``expedited`` for its sync loads."""
    load = cast("Callable[..., bool]", worker.submit_load)
    return load(job_id, slots, device_side(spec, kv_caches), expedited=expedited)
