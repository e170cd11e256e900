"""Compile a @triton.jit kernel for a GPU target on any machine (no GPU needed) and return its assembly.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` runs the
whole NVIDIA pipeline down to PTX on a CPU-only machine, which is what the
code-quality tests and ``bench/kernels.py --ptx`` inspect. The ``attrs``
format (which arguments are 16-byte divisible) is the one of Triton >= 3.3;
older Triton raises :class:`UnsupportedTriton`.
"""

from collections.abc import Mapping, Sequence


class UnsupportedTriton(RuntimeError):
    """This Triton version's ASTSource API is not the one this helper speaks."""


def _kernel(name: str):
    from .copy_pages import copy_pages_kernel
    from .descriptor_copy import descriptor_copy_kernel

    kernels = {"copy_pages": copy_pages_kernel, "descriptor_copy": descriptor_copy_kernel}
    if name not in kernels:
        raise ValueError(f"kernel must be one of {sorted(kernels)}, got {name!r}")
    return kernels[name]


def compile_asm(
    kernel: str,
    *,
    signature: Mapping[str, str],
    constexprs: Mapping[str, int | bool],
    divisible_by_16: Sequence[str],
    num_warps: int,
    arch: int = 90,
) -> dict[str, str]:
    """Compile the named kernel of this folder for ``sm_<arch>``; returns ``{"ttir": ..., "ptx": ...}``.

    ``divisible_by_16`` names the pointer and integer arguments that Triton's
    launcher would specialise as 16-divisible at a real launch.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton.runtime.jit import JITFunction

    # Always the compiled flavour, even when TRITON_INTERPRET made @triton.jit an interpreter.
    jit_fn = JITFunction(_kernel(kernel).fn)
    names = list(jit_fn.arg_names)
    full_signature = {name: signature[name] if name in signature else "constexpr" for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible_by_16}
    try:
        source = ASTSource(fn=jit_fn, signature=full_signature, constexprs=dict(constexprs), attrs=attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "enable_fp_fusion": False})
    except (TypeError, AttributeError, KeyError) as error:
        raise UnsupportedTriton(f"triton {triton.__version__}: cannot compile through ASTSource here ({error})") from error
    return {"ttir": str(compiled.asm["ttir"]), "ptx": str(compiled.asm["ptx"])}
