"""The two forms of one ``@triton.jit`` kernel, compiled for the GPU or run by the interpreter, chosen per call.

``@triton.jit`` picks one mode from ``TRITON_INTERPRET`` when a kernel's module
is imported; CUDA tensors must always take the compiled kernel and CPU tensors
the interpreter, whatever the environment said at import time.
"""


class KernelVariants:
    """The compiled and the interpreted form of ``kernel`` (a ``triton.JITFunction``), each built on first use."""

    def __init__(self, kernel, do_not_specialize: tuple[str, ...]) -> None:
        self._raw = kernel.fn
        self._do_not_specialize = do_not_specialize
        self._forms = {}

    def kernel(self, interpret: bool):
        """The interpreted form (``interpret``) or the compiled one: what a launch indexes with its grid."""
        if interpret not in self._forms:
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction

            self._forms[interpret] = (
                InterpretedFunction(self._raw)
                if interpret
                else JITFunction(self._raw, do_not_specialize=self._do_not_specialize)
            )
        return self._forms[interpret]

    def compiled_count(self, device_index: int) -> int:
        """How many variants Triton's launcher has compiled of this kernel on this device so far.

        Triton >= 3.3 keeps them in ``device_caches[device][0]``, older releases in ``cache[device]``.
        """
        compiled = self.kernel(False)
        caches = getattr(compiled, "device_caches", None)
        if caches is not None:
            return len(caches[device_index][0])
        return len(compiled.cache[device_index])
