"""kvtriton without the ``xxhash`` package: everything imports, and only a seal or a slot digest asks for it.

A vLLM server's environment (vLLM does not bring xxhash) and the GPU check's
machine (python, torch, triton, numpy, pytest, hypothesis, nothing else) lack
it. Each case runs in a fresh interpreter where ``import xxhash`` fails, as it
fails there.
"""

from __future__ import annotations

import os

from packaging_fixtures import ROOT, missing_package_errors, run_python_without

IMPORTED_WITHOUT_IT = (
    # the engine and everything under kvtriton.worker (the shared region's layout reaches the seal's size)
    "kvtriton", "kvtriton.worker", "kvtriton.worker._slab", "kvtriton.worker._shared_region",
    "kvtriton.worker._slot_digests", "kvtriton._region_rows", "kvtriton.cli", "kvtriton.sim",
    # what a vLLM server loads (vLLM is installed here, as there)
    "kvtriton.integrations.vllm", "kvtriton.integrations.vllm._worker", "kvtriton.integrations.vllm._tiered_spec",
    # every step of bench/gpu_check.sh
    "bench.common", "bench.gpu_preflight", "bench.crossover", "bench.kernels", "bench.host_cost", "bench.gpu_summary",
)  # fmt: skip


def test_every_module_the_engine_a_vllm_server_and_the_gpu_check_load_imports_without_xxhash() -> None:
    run = run_python_without("xxhash", "\n".join(f"import {module}" for module in IMPORTED_WITHOUT_IT))
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_first_seal_and_the_first_slot_digest_name_the_missing_package() -> None:
    setup = (
        "from kvtriton._integrity import SEAL_BYTES, seal\n"
        "from kvtriton.worker._slab import HostSlab\n"
        "from kvtriton.worker._slot_digests import SlotDigests\n"
        "assert SEAL_BYTES == 64"
    )
    attempts = ("seal(b'x', key=b'k', fingerprint=bytes(16))", "SlotDigests(HostSlab(2, 1, 64, pin=False)).record([0])")
    lines = missing_package_errors("xxhash", setup, attempts)
    assert len(lines) == 2
    assert all(line.startswith("xxhash | ") and "pip install 'xxhash>=2.0'" in line for line in lines)


def test_the_specs_that_will_seal_refuse_at_start_up_naming_the_package() -> None:
    """The tiered spec seals every chunk a tier gets, the single-tier debug mode digests every slot: without xxhash
    each refuses when vLLM builds it, not at its first seal mid-serve; the single-tier spec without the debug mode
    needs nothing."""
    setup = (
        "from tiering_fixtures.configs import tiering_config\n"
        "from vllm_fixtures.builders import offloading_config\n"
        "from vllm.v1.kv_offload.factory import OffloadingSpecFactory\n"
        "fs = [{'type': 'fs', 'root_dir': '/tmp/kvtriton-never-written'}]\n"
        "plain = OffloadingSpecFactory.create_spec(offloading_config({'cpu_bytes_to_use': 1 << 20}))"
    )
    attempts = (
        "OffloadingSpecFactory.create_spec(tiering_config({'cpu_bytes_to_use': 1 << 20, 'secondary_tiers': fs}))",
        "OffloadingSpecFactory.create_spec(offloading_config({'cpu_bytes_to_use': 1 << 20, "
        "'kvtriton_verify_host_loads': True}))",
    )
    paths = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    lines = missing_package_errors("xxhash", setup, attempts, env={**os.environ, "PYTHONPATH": paths})
    assert len(lines) == 2  # the plain spec, built first, needed nothing
    assert all(line.startswith("xxhash | ") and "pip install 'xxhash>=2.0'" in line for line in lines)
