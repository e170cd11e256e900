"""kvtriton.worker._cudart without CUDA: nothing to load, and a strided copy says why it cannot run."""

from __future__ import annotations

import pytest

from kvtriton.worker._cudart import CudaRuntimeError, last_error, loaded_cudart, memcpy_2d_async

pytestmark = pytest.mark.skipif(loaded_cudart() is not None, reason="a libcudart is loaded (a CUDA build of torch)")


def test_without_libcudart_the_last_error_reads_as_none_and_copies_refuse_with_the_reason() -> None:
    assert last_error() == 0
    with pytest.raises(CudaRuntimeError, match="libcudart is not loaded in this process"):
        memcpy_2d_async(0, 64, 0, 64, 64, 1, 0)
