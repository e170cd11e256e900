"""Compile a @triton.jit kernel for a GPU target on any machine (no GPU needed) and return its assembly.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` runs the
whole NVIDIA pipeline down to PTX on a CPU-only machine, which is what the
code-quality tests and ``bench/kernels.py --ptx`` inspect. The ``attrs``
format (which arguments are 16-byte divisible) is the one of Triton >= 3.3;
older Triton raises :class:`UnsupportedTriton`. A development tool: it lives
in bench/, outside the wheel.

Triton ships no type information, so its modules are imported by name and
each value taken from them is given its type here, once (the ``cast`` calls).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, cast

_KERNELS = {
    "copy_pages": ("kvtriton.kernels.jit.copy_pages", "copy_pages_kernel"),
    "descriptor_copy": ("kvtriton.kernels.jit.descriptor_copy", "descriptor_copy_kernel"),
    "compress_pages": ("kvtriton.kernels.jit.compress_pages", "compress_pages_kernel"),
}


class UnsupportedTriton(RuntimeError):
    """This Triton version's ASTSource API is not the one this helper speaks."""


class _JitFunction(Protocol):
    """The part of ``triton.runtime.jit.JITFunction`` this helper uses."""

    @property
    def arg_names(self) -> list[str]: ...

    @property
    def fn(self) -> Callable[..., object]: ...


class _Compiled(Protocol):
    @property
    def asm(self) -> Mapping[str, object]: ...


def _from(module: str, name: str) -> object:
    return cast(object, getattr(importlib.import_module(module), name))


def _kernel(name: str) -> _JitFunction:
    if name not in _KERNELS:
        raise ValueError(f"kernel must be one of {sorted(_KERNELS)}, got {name!r}")
    return cast(_JitFunction, _from(*_KERNELS[name]))


def compile_asm(
    kernel: str,
    *,
    signature: Mapping[str, str],
    constexprs: Mapping[str, int | bool],
    divisible_by_16: Sequence[str],
    num_warps: int,
    arch: int = 90,
) -> dict[str, str]:
    """Compile the named kernel of ``kvtriton.kernels.jit`` for ``sm_<arch>``; returns ``{"ttir": ..., "ptx": ...}``.

    ``divisible_by_16`` names the pointer and integer arguments that Triton's
    launcher would specialise as 16-divisible at a real launch.
    """
    jit_function = cast(Callable[..., _JitFunction], _from("triton.runtime.jit", "JITFunction"))
    gpu_target = cast(Callable[..., object], _from("triton.backends.compiler", "GPUTarget"))
    ast_source = cast(Callable[..., object], _from("triton.compiler", "ASTSource"))
    compile_fn = cast(Callable[..., _Compiled], _from("triton", "compile"))
    version = cast(str, _from("triton", "__version__"))
    # Always the compiled flavour, even when TRITON_INTERPRET made @triton.jit an interpreter.
    jit_fn = jit_function(_kernel(kernel).fn)
    names = list(jit_fn.arg_names)
    full_signature = {name: signature[name] if name in signature else "constexpr" for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible_by_16}
    try:
        source = ast_source(fn=jit_fn, signature=full_signature, constexprs=dict(constexprs), attrs=attrs)
        compiled = compile_fn(source, target=gpu_target("cuda", arch, 32), options={"num_warps": num_warps, "enable_fp_fusion": False})
    except (TypeError, AttributeError, KeyError) as error:
        raise UnsupportedTriton(f"triton {version}: cannot compile through ASTSource here ({error})") from error
    return {"ttir": str(compiled.asm["ttir"]), "ptx": str(compiled.asm["ptx"])}
