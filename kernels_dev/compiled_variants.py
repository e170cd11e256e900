"""Registers and spills of every kernel variant Triton compiled in this process: what ``ptxas`` made of each.

``bench/gpu_check.sh`` runs the kernels under the GPU machine's Triton (3.6),
while the CPU gate compiles PTX with another (3.9): a variant that spills
there, or needs many more registers, reads slower for a reason no CPU check
can see. :func:`compiled_variants` lists, for the copy kernel and the fused
fp8 kernel, each variant compiled so far with its ``n_regs`` and ``n_spills``
(Triton reads them when it loads the binary, so a variant compiled but never
launched has none yet) and the compile-time constants it was specialised on.
Without CUDA nothing is compiled and the list is empty. The GPU check
(``bench/kernels.py --gpu-check``, ``bench/gpu_preflight.py``) reports them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import cast


def _number(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _mapping(value: object) -> Mapping[object, object]:
    """``value`` when it is a mapping (Triton's caches and constants are plain untyped dicts), else empty."""
    return cast(Mapping[object, object], value) if isinstance(value, Mapping) else {}


def _constants(source: object) -> dict[str, str]:
    """The variant's compile-time constants by parameter name (Triton keys them by ``(index,)`` or by name)."""
    names: object = getattr(getattr(source, "fn", None), "arg_names", None)
    arg_names = [str(name) for name in cast(list[object], names)] if isinstance(names, list) else []
    found: dict[str, str] = {}
    for key, value in _mapping(getattr(source, "constants", None)).items():
        key_text = str(key)
        parts = cast(tuple[object, ...], key) if isinstance(key, tuple) else ()
        index = parts[0] if len(parts) == 1 else None
        name = arg_names[index] if isinstance(index, int) and 0 <= index < len(arg_names) else key_text
        found[name] = str(value)
    return found


def describe_variant(kernel: str, compiled: object) -> dict[str, object]:
    """One compiled variant (Triton's ``CompiledKernel``) as a record; a field Triton does not have reads None."""
    metadata: object = getattr(compiled, "metadata", None)
    return {
        "kernel": kernel,
        "num_warps": _number(getattr(metadata, "num_warps", None)),
        "shared_bytes": _number(getattr(metadata, "shared", None)),
        "n_regs": _number(getattr(compiled, "n_regs", None)),
        "n_spills": _number(getattr(compiled, "n_spills", None)),
        "constants": _constants(getattr(compiled, "src", None)),
    }


def variant_records(kernel: str, jit_function: object) -> list[dict[str, object]]:
    """Every variant compiled for ``jit_function`` (a ``JITFunction``) on any device, in compile order.

    Triton >= 3.3 keeps them in ``device_caches[device][0]`` (key -> compiled kernel), as
    ``KernelVariants.compiled_count`` (``kvtriton/kernels/_jit/variants.py``) reads them.
    """
    records: list[dict[str, object]] = []
    for entry in _mapping(getattr(jit_function, "device_caches", None)).values():
        parts = cast(tuple[object, ...], entry) if isinstance(entry, tuple) else ()
        kernels = parts[0] if parts else None
        records += [describe_variant(kernel, compiled) for compiled in _mapping(kernels).values()]
    return records


def compiled_variants() -> list[dict[str, object]]:
    """The copy kernel's and the fp8 kernel's variants compiled in this process so far (imports triton)."""
    from kvtriton.kernels._jit import compress_pages, copy_pages

    # The compiled JITFunctions each launcher uses.
    copy_kernel = cast(object, copy_pages.VARIANTS.kernel(False))
    fp8_kernel = cast(object, compress_pages.VARIANTS.kernel(False))
    return variant_records("copy_pages", copy_kernel) + variant_records("compress_pages", fp8_kernel)


def format_variant(record: Mapping[str, object], keys: Iterable[str] = ()) -> str:
    """``copy_pages  regs 40  spills 0  warps 4  TO_SLAB=True ...``, the constants named in ``keys`` (default: all)."""
    wanted = set(keys)
    shown = {str(k): str(v) for k, v in _mapping(record.get("constants")).items() if not wanted or k in wanted}
    text = " ".join(f"{name}={value}" for name, value in shown.items())
    return (
        f"{record.get('kernel')}  regs {record.get('n_regs', '-')}  spills {record.get('n_spills', '-')}  "
        f"warps {record.get('num_warps', '-')}  {text}"
    ).rstrip()
