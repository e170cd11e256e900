"""Byte offsets past 2**31 (and 2**32) are addressed correctly: no 32-bit index arithmetic anywhere.

The big tensors are sparse memory-mapped files: only the pages actually
touched take memory, so the test stays cheap (checked below).
"""

from __future__ import annotations

import resource
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtriton.kernels import DEFAULT_BYTES_PER_ITER, gather_pages, scatter_pages
from tests.kernels.kernel_cases import indices

PAGE = 1024
FAR = 2**22 + 3  # index whose byte offset is past 2**32 for 1 KiB+ rows and blocks
# Both kernel paths: 1 KiB per iteration is one pair per unit; the default
# stacks 16 pairs of 1 KiB pages into a tile (block and row ids as vectors).
PATHS = pytest.mark.parametrize(
    "bytes_per_iter", [PAGE, DEFAULT_BYTES_PER_ITER], ids=["one-pair-per-unit", "tile-of-pairs"]
)


def sparse_bytes(path: Path, size: int) -> torch.Tensor:
    """A uint8 tensor of ``size`` bytes backed by a sparse file (zero until written)."""
    with path.open("wb") as handle:
        handle.truncate(size)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@pytest.fixture
def memory_guard() -> Iterator[None]:
    before = max_rss_bytes()
    yield
    # Touching every byte of a 4 GiB sparse file would show here.
    assert max_rss_bytes() - before < 256 * 2**20


@PATHS
@pytest.mark.usefixtures("memory_guard")
def test_a_slab_row_beyond_4_gib_is_gathered_and_scattered(tmp_path: Path, bytes_per_iter: int) -> None:
    rows = FAR + 2
    row_bytes = 2 * PAGE + 32
    slab = sparse_bytes(tmp_path / "slab.bin", rows * row_bytes).view(rows, row_bytes)
    assert FAR * row_bytes > 2**32
    pages = [torch.randint(-128, 127, (4, PAGE), dtype=torch.int8) for _ in range(2)]
    gather_pages(
        pages,
        slab,
        indices([3, 1], torch.int32, "cpu"),
        indices([FAR, 5], torch.int32, "cpu"),
        bytes_per_iter=bytes_per_iter,
    )
    assert torch.equal(slab[FAR, :PAGE], pages[0][3].view(torch.uint8))
    assert torch.equal(slab[FAR, PAGE : 2 * PAGE], pages[1][3].view(torch.uint8))
    assert torch.equal(slab[5, PAGE : 2 * PAGE], pages[1][1].view(torch.uint8))
    # Nothing landed where a wrapped 32-bit offset would point.
    wrapped = (FAR * row_bytes) % 2**32
    assert int(slab.view(-1)[wrapped : wrapped + PAGE].count_nonzero()) == 0
    targets = [torch.zeros(4, PAGE, dtype=torch.int8) for _ in range(2)]
    scatter_pages(
        slab,
        targets,
        indices([FAR], torch.int32, "cpu"),
        indices([2], torch.int32, "cpu"),
        bytes_per_iter=bytes_per_iter,
    )
    assert torch.equal(targets[0][2], pages[0][3]) and torch.equal(targets[1][2], pages[1][3])


@PATHS
@pytest.mark.usefixtures("memory_guard")
def test_a_block_beyond_4_gib_in_a_page_tensor_is_gathered_and_scattered(tmp_path: Path, bytes_per_iter: int) -> None:
    blocks = FAR + 2
    cache = sparse_bytes(tmp_path / "cache.bin", blocks * 2 * PAGE).view(blocks, 2, PAGE)
    pages = [cache[:, 0], cache[:, 1]]  # strided views: block stride 2 KiB
    slab = torch.randint(0, 256, (3, 2 * PAGE), dtype=torch.uint8)
    scatter_pages(
        slab, pages, indices([2], torch.int64, "cpu"), indices([FAR], torch.int64, "cpu"), bytes_per_iter=bytes_per_iter
    )
    assert torch.equal(cache[FAR].reshape(-1), slab[2])
    out = torch.zeros(3, 2 * PAGE, dtype=torch.uint8)
    gather_pages(
        pages, out, indices([FAR], torch.int64, "cpu"), indices([0], torch.int64, "cpu"), bytes_per_iter=bytes_per_iter
    )
    assert torch.equal(out[0], slab[2])


DEVICE_PAGE = 4096
DEVICE_BLOCKS = (2**32 + 2**27) // DEVICE_PAGE  # a ~4.1 GiB page tensor: its last blocks start past 4 GiB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@PATHS
def test_cuda_a_block_beyond_4_gib_of_a_device_page_tensor_is_gathered_and_scattered(bytes_per_iter: int) -> None:
    from kvtriton.worker._slab import HostSlab

    cache = torch.empty((DEVICE_BLOCKS, DEVICE_PAGE), dtype=torch.uint8, device="cuda")
    far = DEVICE_BLOCKS - 2
    assert far * DEVICE_PAGE > 2**32
    wrapped = (far * DEVICE_PAGE) % 2**32 // DEVICE_PAGE  # where a 32-bit byte offset would land
    generator = torch.Generator().manual_seed(0)
    cache[far] = torch.randint(0, 256, (DEVICE_PAGE,), dtype=torch.uint8, generator=generator).cuda()
    cache[3] = torch.randint(0, 256, (DEVICE_PAGE,), dtype=torch.uint8, generator=generator).cuda()
    cache[wrapped].zero_()
    cache[far + 1].zero_()
    with HostSlab(4, 1, DEVICE_PAGE, pin=True) as slab:
        gather_pages(
            [cache],
            slab.rows,
            indices([far, 3], torch.int32, "cuda"),
            indices([0, 1], torch.int32, "cuda"),
            bytes_per_iter=bytes_per_iter,
        )
        torch.cuda.synchronize()
        assert torch.equal(slab.rows[0], cache[far].cpu()) and torch.equal(slab.rows[1], cache[3].cpu())
        slab.rows[2] = torch.randint(1, 256, (DEVICE_PAGE,), dtype=torch.uint8, generator=generator)
        scatter_pages(
            slab.rows,
            [cache],
            indices([2], torch.int32, "cuda"),
            indices([far + 1], torch.int32, "cuda"),
            bytes_per_iter=bytes_per_iter,
        )
        assert torch.equal(cache[far + 1].cpu(), slab.rows[2])
    assert int(cache[wrapped].count_nonzero()) == 0  # nothing landed at the wrapped offset
    del cache
    torch.cuda.empty_cache()
