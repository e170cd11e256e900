"""The serving benchmark's CPU copy path for LMCache (bench/lmcache_cpu_connector.py), without LMCache installed.

The copier is checked against vLLM's CPU attention's own reading of its cache
(a layer viewed as ``[blocks, heads, 2 * block size, head size]`` and cut in
two along its third axis: K rows, then V rows), so that a token stored and
loaded back lands where vLLM reads it; the factory wrapping is checked on a
stand-in ``lmcache`` package.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from bench.lmcache_cpu_connector import PagedCPUCopier, install_cpu_copy_path, with_resumed_req_ids

LAYERS, HEADS, HEAD_SIZE, BLOCKS, BLOCK_SIZE = 3, 2, 4, 5, 8


def vllm_k_and_v(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as vLLM's CPU attention reads them: each ``[blocks, heads, block size, head size]``."""
    blocks, heads, block_size, _ = layer.shape
    key, value = layer.view(blocks, heads, block_size * 2, -1).chunk(2, dim=2)
    return key, value


def random_caches(seed: int) -> list[torch.Tensor]:
    draw = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, generator=draw) for _ in range(LAYERS)]


@dataclass
class MemoryObj:
    tensor: torch.Tensor | None


def test_a_stored_token_holds_vllms_k_and_v_of_its_slot_in_lmcaches_layout() -> None:
    caches = random_caches(0)
    copier = PagedCPUCopier(LAYERS, HEADS, HEAD_SIZE)
    slot_mapping = torch.tensor([17, 3, 39, 8, 9, 30])  # blocks 2, 0, 4, 1, 1, 3
    start, end = 1, 5
    stored = MemoryObj(torch.zeros(copier.get_shape(end - start)))
    copier.batched_from_gpu([stored], [start], [end], kvcaches=caches, slot_mapping=slot_mapping)
    assert stored.tensor is not None and stored.tensor.shape == (2, LAYERS, 4, HEADS * HEAD_SIZE)
    for layer, cache in enumerate(caches):
        key, value = vllm_k_and_v(cache)
        for token, slot in enumerate(int(slot) for slot in slot_mapping[start:end]):
            block, offset = divmod(slot, BLOCK_SIZE)
            assert torch.equal(stored.tensor[0, layer, token], key[block, :, offset].reshape(-1))
            assert torch.equal(stored.tensor[1, layer, token], value[block, :, offset].reshape(-1))


def test_a_loaded_chunk_lands_in_its_slots_and_leaves_vllms_own_cached_tokens_alone() -> None:
    source = random_caches(1)
    copier = PagedCPUCopier(LAYERS, HEADS, HEAD_SIZE)
    stored_slots = torch.arange(0, 6)
    stored = MemoryObj(torch.zeros(copier.get_shape(6)))
    copier.from_gpu(stored, 0, 6, kvcaches=source, slot_mapping=stored_slots)

    target = [torch.zeros_like(layer) for layer in source]
    load_slots = torch.tensor([33, 34, 35, 36, 37, 38])  # block 4, offsets 1-6
    # The first 2 tokens are in vLLM's own prefix cache already: the copier must not write their slots.
    copier.batched_to_gpu([stored], [0], [6], kvcaches=target, slot_mapping=load_slots, vllm_cached_tokens=2)
    for layer in range(LAYERS):
        key, value = vllm_k_and_v(target[layer])
        source_key, source_value = vllm_k_and_v(source[layer])
        for token in range(6):
            slot = int(load_slots[token])
            block, offset = divmod(slot, BLOCK_SIZE)
            if token < 2:
                assert not key[block, :, offset].any() and not value[block, :, offset].any()
            else:
                assert torch.equal(key[block, :, offset], source_key[0, :, token])
                assert torch.equal(value[block, :, offset], source_value[0, :, token])
        # Nothing else was written: the block's other slots, every other block.
        written = torch.zeros(BLOCKS, BLOCK_SIZE, dtype=torch.bool)
        written[4, 3:7] = True
        assert not key.permute(0, 2, 1, 3)[~written].any() and not value.permute(0, 2, 1, 3)[~written].any()


def test_another_cache_layout_bad_slots_or_missing_caches_are_refused_with_what_was_given() -> None:
    copier = PagedCPUCopier(LAYERS, HEADS, HEAD_SIZE)
    memory = MemoryObj(torch.zeros(copier.get_shape(2)))
    nhd = [torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD_SIZE) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match=r"expected vLLM's CPU cache layout .* got \[5, 8, 2, 8\]"):
        copier.from_gpu(memory, 0, 2, kvcaches=nhd, slot_mapping=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"slot_mapping\[0:2\] must name a slot for every token .* 1 negative"):
        copier.from_gpu(memory, 0, 2, kvcaches=random_caches(2), slot_mapping=torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match="expected 3 layers' caches, got 1"):
        PagedCPUCopier(LAYERS, HEADS, HEAD_SIZE).from_gpu(
            memory, 0, 2, kvcaches=random_caches(2)[:1], slot_mapping=torch.tensor([0, 1])
        )
    with pytest.raises(ValueError, match="passed no kvcaches"):
        PagedCPUCopier(LAYERS, HEADS, HEAD_SIZE).from_gpu(memory, 0, 2, slot_mapping=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="kvcaches must be a list of tensors, got dict"):
        copier.initialize_kvcaches_ptr(kvcaches={"layer": torch.zeros(1)})


@dataclass
class Config:
    use_layerwise: bool = False
    enable_blending: bool = False


@dataclass
class Metadata:
    kv_shape: tuple[int, ...] = (LAYERS, 2, 32, HEADS, HEAD_SIZE)
    use_mla: bool = False


class Engine:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.fixture
def stand_in_lmcache(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """An ``lmcache`` package with LMCache's connector factory's signature, on a CPU torch."""
    package, v1, factory = (types.ModuleType(n) for n in ("lmcache", "lmcache.v1", "lmcache.v1.gpu_connector"))
    setattr(package, "torch_device_type", "cpu")  # ModuleType has no such attribute for the type checker

    def create(config: object, metadata: object, engine: Engine, layout_hints: object = None) -> object:
        if engine.name == "VLLM":
            raise RuntimeError("No supported cpu connector found.")
        return ("lmcache's own", engine.name, layout_hints)

    setattr(factory, "CreateGPUConnector", create)  # the same
    for name, module in (("lmcache", package), ("lmcache.v1", v1), ("lmcache.v1.gpu_connector", factory)):
        monkeypatch.setitem(sys.modules, name, module)
    return factory


def test_the_wrapped_factory_gives_vllm_on_a_cpu_torch_the_copier_and_everything_else_lmcaches_own(
    stand_in_lmcache: types.ModuleType,
) -> None:
    install_cpu_copy_path()
    wrapped = stand_in_lmcache.CreateGPUConnector
    install_cpu_copy_path()  # idempotent: a second connector in the process wraps nothing twice
    assert stand_in_lmcache.CreateGPUConnector is wrapped
    copier = wrapped(Config(), Metadata(), Engine("VLLM"), layout_hints={"kv_layout": "NHD"})
    assert isinstance(copier, PagedCPUCopier) and copier.get_shape(7) == (2, LAYERS, 7, HEADS * HEAD_SIZE)
    assert wrapped(Config(), Metadata(), Engine("SGLANG"), layout_hints=None) == ("lmcache's own", "SGLANG", None)
    with pytest.raises(ValueError, match="synchronous whole-request copies only.*got True, False"):
        wrapped(Config(use_layerwise=True), Metadata(), Engine("VLLM"))
    with pytest.raises(ValueError, match="MLA"):
        wrapped(Config(), Metadata(use_mla=True), Engine("VLLM"))


def test_lmcache_reads_no_cached_request_as_resumed_on_a_vllm_without_the_field_and_vllms_output_is_untouched() -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    output = SchedulerOutput.make_empty()
    answered = with_resumed_req_ids(output)
    if hasattr(output.scheduled_cached_reqs, "resumed_req_ids"):  # vLLM 0.33: its own answer stands
        assert answered is output
    else:  # vLLM 0.34 sends a resumed request again as a new one
        assert getattr(answered.scheduled_cached_reqs, "resumed_req_ids") == set()
        assert not hasattr(output.scheduled_cached_reqs, "resumed_req_ids")
        assert answered.scheduled_cached_reqs.req_ids is output.scheduled_cached_reqs.req_ids
