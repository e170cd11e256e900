"""No compilation while serving: after warm-up, no job asks Triton for a kernel variant it does not have.

Triton compiles one variant per specialisation key: the constexprs,
``num_warps`` and, per runtime argument, its type and whether it is 16-byte
aligned (pointers) or divisible by 16 / equal to 1 (ints). ``record_variants``
collects the key of every launch as Triton's own binder computes it, on the
interpreter path too, so these CPU tests see exactly what a GPU would compile.
"""

from __future__ import annotations

import pytest
import torch

from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.kernels._launch import CopyLauncher, record_variants
from kvtriton.worker._engine import TransferEngine
from kvtriton.worker._layout import PagedKV
from kvtriton.worker._slab import HostSlab

pytestmark = pytest.mark.requires_interpreter

BLOCKS = 300
JOB_SIZES = (1, 2, 3, 7, 16, 33, 64, 129, 257)


def make_kv() -> PagedKV:
    generator = torch.Generator().manual_seed(3)
    tensors = [
        torch.randint(-(2**15), 2**15, (2, BLOCKS, 2, 8), dtype=torch.int16, generator=generator) for _ in range(2)
    ]
    return PagedKV.from_tensors(tensors, layout="flash_attn")


def test_jobs_of_every_size_request_only_the_variants_warm_up_compiled() -> None:
    kv = make_kv()
    with HostSlab(BLOCKS, 1, kv.row_bytes, pin=False) as slab:
        with record_variants() as warmed:
            engine = TransferEngine(kv, slab, "triton")
        assert len(warmed) == 2  # gather and scatter
        with engine, record_variants() as requested:
            job = 0
            for size in JOB_SIZES:
                blocks = list(range(size))
                slots = list(range(BLOCKS - size, BLOCKS))
                assert engine.submit_store(job, GPULoadStoreSpec(blocks), CPULoadStoreSpec(slots))
                assert engine.submit_load(
                    job + 1, CPULoadStoreSpec(slots), GPULoadStoreSpec(blocks), expedited=size % 2 == 1
                )
                job += 2
            results = engine.get_finished()
        assert len(results) == 2 * len(JOB_SIZES) and all(result.success for result in results)
        assert requested <= warmed, f"jobs asked for variants warm-up did not make: {requested - warmed}"
        assert len(requested) == 2


def test_the_key_sees_a_misaligned_index_pointer_so_the_check_above_has_teeth() -> None:
    # Rows staged right after an odd number of blocks in one buffer start 8
    # bytes off a 16-byte boundary: a second variant on a GPU.
    kv = make_kv()
    with HostSlab(4, 1, kv.row_bytes, pin=False) as slab:
        launcher = CopyLauncher(
            kv.pages, slab.rows, kv.geometry, interpret=True, num_programs=4, bytes_per_iter=16 * 1024
        )
        shared = torch.zeros(6, dtype=torch.int64)
        with record_variants() as aligned:
            launcher.launch(True, shared[0:2], shared[2:4])
        with record_variants() as shifted:
            launcher.launch(True, shared[0:1], shared[1:2])
        assert aligned != shifted
