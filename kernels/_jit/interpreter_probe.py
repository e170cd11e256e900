"""Can this machine's Triton interpreter run the copy kernel's loops?

The copy kernel walks its work units in a loop whose bound is a runtime
argument. Triton's interpreter before 3.7 turns that argument into a
one-element numpy array and calls ``int()`` on it, which NumPy >= 2.4 refuses
("only 0-dimensional arrays can be converted to Python scalars"): on such a
machine (e.g. Triton 3.6 with a current NumPy) no kernel with a dynamic loop
can run under ``TRITON_INTERPRET=1``, while compiled CUDA launches are fine.
Probing a tiny kernel once says so up front, in words, instead of an
``InterpreterError`` deep inside a copy.
"""

import functools

import triton
import triton.language as tl


@triton.jit
def _dynamic_loop_probe_kernel(out_ptr, n):
    for i in range(0, n):
        tl.store(out_ptr + i, i)


@functools.cache
def interpreter_problem() -> str | None:
    """``None`` when the interpreter runs a dynamic loop here; otherwise why it cannot (cached)."""
    import numpy
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    out = torch.zeros(3, dtype=torch.int32)
    try:
        InterpretedFunction(_dynamic_loop_probe_kernel.fn)[(1,)](out, 3)
    except Exception as error:  # noqa: BLE001 -- any failure means the kernels cannot run here
        return (
            f"the Triton {triton.__version__} interpreter cannot run a loop with a runtime bound "
            f"under NumPy {numpy.__version__} ({type(error).__name__}: {error})"
        )
    if out.tolist() != [0, 1, 2]:
        return f"the Triton {triton.__version__} interpreter computed {out.tolist()} for a three-step loop"
    return None
