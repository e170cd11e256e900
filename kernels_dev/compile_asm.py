"""Compile a @triton.jit kernel for a GPU target on any machine (no GPU needed) and return its assembly.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` runs the
whole NVIDIA pipeline down to PTX on a CPU-only machine, which is what the
code-quality tests and ``bench/kernels.py --ptx`` inspect. The ``attrs``
format (which arguments are 16-byte divisible) is the one of Triton >= 3.3;
older Triton raises :class:`UnsupportedTriton`. A development tool: it lives
in ``kernels_dev/``, outside the wheel.

Every compile runs in one child process with the interpreter off, never in the
caller's process. The test suite runs with ``TRITON_INTERPRET=1``, and an
interpreted kernel that calls a ``@triton.jit`` helper (``tl.max``, ``tl.sum``)
patches the builtins of ``triton.language.core`` for good; a compile in that
process then fails (``'value' object has no attribute 'dtype'``) unless Triton's
on-disk cache already holds the kernel. So in-process compiles passed on a warm
cache and failed on every new machine. The child is started on the first
compile and kept for the rest of the process: one import of torch and triton,
whatever number of kernels.

Triton ships no type information, so its modules are imported by name and
each value taken from them is given its type here, once (the ``cast`` calls).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, cast

_KERNELS = {
    "copy_pages": ("kvtriton.kernels._jit.copy_pages", "copy_pages_kernel"),
    "descriptor_copy": ("kvtriton.kernels._jit.descriptor_copy", "descriptor_copy_kernel"),
    "compress_pages": ("kvtriton.kernels._jit.compress_pages", "compress_pages_kernel"),
}
# The repository root, which holds the kvtriton package and kernels_dev (this file is kernels_dev/compile_asm.py):
# the child imports this checkout's kvtriton and this module, whatever its working directory.
_REPOSITORY = Path(__file__).resolve().parents[1]


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
    """Compile the named kernel of ``kvtriton.kernels._jit`` for ``sm_<arch>``; returns ``{"ttir": ..., "ptx": ...}``.

    ``divisible_by_16`` names the pointer and integer arguments that Triton's
    launcher would specialise as 16-divisible at a real launch. The compile runs
    in the compile process (see the module docstring).
    """
    _kernel(kernel)  # an unknown name is refused here, before the child is asked
    request = {
        "kernel": kernel,
        "signature": dict(signature),
        "constexprs": dict(constexprs),
        "divisible_by_16": list(divisible_by_16),
        "num_warps": num_warps,
        "arch": arch,
    }
    answer = _compile_process().ask(request)
    if "unsupported" in answer:
        raise UnsupportedTriton(answer["unsupported"])
    if "error" in answer:
        raise RuntimeError(f"compiling {kernel} in the compile process failed:\n{answer['error']}")
    return {"ttir": answer["ttir"], "ptx": answer["ptx"]}


class _CompileProcess:
    """``python -m kernels_dev.compile_asm``: one request per line on its stdin, one JSON answer per line on its stdout."""

    def __init__(self) -> None:
        environment = {**os.environ, "TRITON_INTERPRET": "0"}
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPOSITORY), environment.get("PYTHONPATH")]))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "kernels_dev.compile_asm"],
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        atexit.register(self.close)

    def ask(self, request: Mapping[str, object]) -> dict[str, str]:
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None and stdout is not None  # both are pipes (Popen above)
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            code = self._process.wait()
            raise RuntimeError(f"the compile process ended (exit code {code}) before answering; its stderr is above")
        return cast("dict[str, str]", json.loads(line))

    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self) -> None:
        """End of input ends the child; then both pipes are closed."""
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
        self._process.wait(timeout=30)


_compile_process_instance: list[_CompileProcess] = []


def _compile_process() -> _CompileProcess:
    """The compile process of this process, started on first use and again if it died."""
    if not _compile_process_instance or not _compile_process_instance[0].alive():
        _compile_process_instance[:] = [_CompileProcess()]
    return _compile_process_instance[0]


def _compile_here(request: Mapping[str, object]) -> dict[str, str]:
    """The child side: compile one request in this (non-interpreting) process."""
    jit_function = cast(Callable[..., _JitFunction], _from("triton.runtime.jit", "JITFunction"))
    gpu_target = cast(Callable[..., object], _from("triton.backends.compiler", "GPUTarget"))
    ast_source = cast(Callable[..., object], _from("triton.compiler", "ASTSource"))
    compile_fn = cast(Callable[..., _Compiled], _from("triton", "compile"))
    version = cast(str, _from("triton", "__version__"))
    signature = cast("dict[str, str]", request["signature"])
    # Always the compiled flavour of the kernel's Python function.
    jit_fn = jit_function(_kernel(cast(str, request["kernel"])).fn)
    names = list(jit_fn.arg_names)
    full_signature = {name: signature[name] if name in signature else "constexpr" for name in names}
    divisible = cast("list[str]", request["divisible_by_16"])
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    options = {"num_warps": cast(int, request["num_warps"]), "enable_fp_fusion": False}
    target = gpu_target("cuda", cast(int, request["arch"]), 32)
    try:
        source = ast_source(fn=jit_fn, signature=full_signature, constexprs=request["constexprs"], attrs=attrs)
        compiled = compile_fn(source, target=target, options=options)
    except (TypeError, AttributeError, KeyError) as error:
        return {"unsupported": f"triton {version}: cannot compile through ASTSource here ({error})"}
    return {"ttir": str(compiled.asm["ttir"]), "ptx": str(compiled.asm["ptx"])}


def _serve() -> None:
    """Answer compile requests until stdin closes. Anything else written to stdout goes to stderr instead."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    for line in sys.stdin:
        try:
            answer = _compile_here(cast("dict[str, object]", json.loads(line)))
        except Exception:  # noqa: BLE001 -- any failure is the caller's answer, not the end of the process
            answer = {"error": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()
