"""The ``@triton.jit`` bodies and their launch wrappers (private: the launchers in ``kvtriton.kernels`` use them)."""

__all__: list[str] = []
