"""vLLM's own Scheduler, OffloadingConnector and TieringOffloadingManager, with kvtriton's worker ranks, on CPU.

The in-process vLLM of ``vllm_fixtures.in_process`` with kvtriton's tiered
spec, and its simulated model: for every full GPU block a request computes,
each rank writes a known pattern (seeded by rank, block index and layer)
into its KV blocks, and :class:`TieredVLLM` records which blocks the model
computed, so a test can tell loaded blocks from recomputed ones. Several
worker ranks (tensor parallelism) each hold half of the KV heads.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.config import ModelConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_fixtures.in_process import BLOCK_SIZE, NUM_GPU_BLOCKS, InProcessVLLM, start_in_process_vllm
from vllm_fixtures.requests import make_request

from kvtriton.integrations.vllm._tiered_spec import KVTritonPrimaryTier
from kvtriton.manager import CPUOffloadingManager

__all__ = [
    "BLOCK_SIZE",
    "HEAD_SIZE",
    "LAYERS",
    "TieredVLLM",
    "fs_tier",
    "kv_spec",
    "start_tiered_vllm",
]

LAYERS = ("layer0", "layer1")
TOTAL_KV_HEADS = 2
HEAD_SIZE = 8
TIERING_SPEC: dict[str, object] = {
    "spec_name": "KVTritonTieringOffloadingSpec",
    "spec_module_path": "kvtriton.integrations.vllm",
}


def kv_spec(world_size: int) -> FullAttentionSpec:
    """One rank's attention spec: the KV heads split evenly over the ranks."""
    return FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=TOTAL_KV_HEADS // world_size, head_size=HEAD_SIZE, dtype=torch.float16
    )


def fs_tier(root: Path, **extra: object) -> dict[str, object]:
    """An ``fs`` secondary tier under ``root`` with few threads (the test machine has two cores)."""
    return {"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2, **extra}


@dataclass(kw_only=True)
class TieredVLLM(InProcessVLLM):
    """The in-process vLLM with kvtriton as the primary tier, and a model that writes known patterns."""

    kvs: list[dict[str, torch.Tensor]]
    """Each rank's layer caches: ``(num_blocks, 2, block_size, heads, head_size)`` (the CPU "GPU")."""
    computed: list[tuple[str, int]] = field(default_factory=lambda: [])
    """(request, block index) of every full block the model computed, in order."""
    gpu_blocks_seen: dict[str, list[int]] = field(default_factory=lambda: {})
    """Each request's GPU blocks as last seen while it ran (they are freed when it finishes)."""

    @property
    def tiering(self) -> TieringOffloadingManager:
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        manager = connector.scheduler.manager
        assert isinstance(manager, TieringOffloadingManager)
        return manager

    @property
    def primary(self) -> KVTritonPrimaryTier:
        primary = self.tiering.primary_tier
        assert isinstance(primary, KVTritonPrimaryTier)
        return primary

    @property
    def cpu(self) -> CPUOffloadingManager:
        return self.primary.cpu

    @property
    def fs(self) -> FileSystemTierManager:
        (tier,) = self.tiering.secondary_tiers
        assert isinstance(tier, FileSystemTierManager)
        return tier

    @staticmethod
    def pattern(rank: int, index: int, layer: str, shape: torch.Size) -> torch.Tensor:
        generator = torch.Generator().manual_seed(10_000 * rank + 100 * index + LAYERS.index(layer))
        values = torch.randint(-(2**15), 2**15, shape, generator=generator, dtype=torch.int32)
        return values.to(torch.int16).view(torch.float16)

    def expected_bytes(self, rank: int, index: int) -> list[bytes]:
        """What the model writes into ``rank``'s layers for prompt block ``index``."""
        return [self.pattern(rank, index, name, self.kvs[rank][name][0].shape).numpy().tobytes() for name in LAYERS]

    def block_bytes(self, rank: int, block: int) -> list[bytes]:
        return [self.kvs[rank][name][block].numpy().tobytes() for name in LAYERS]

    def scrub(self) -> None:
        """Overwrite every rank's GPU KV blocks."""
        for kv in self.kvs:
            for tensor in kv.values():
                tensor.fill_(-1.0)

    def _compute(self, output: SchedulerOutput) -> None:
        for request_id, scheduled in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            # schedule() already advanced num_computed_tokens past this step's tokens.
            start, end = request.num_computed_tokens - scheduled, request.num_computed_tokens
            blocks = self.gpu_blocks(request_id)
            for index in range(-(-start // BLOCK_SIZE), end // BLOCK_SIZE):
                self.computed.append((request_id, index))
                for rank, kv in enumerate(self.kvs):
                    for name in LAYERS:
                        kv[name][blocks[index]].copy_(self.pattern(rank, index, name, kv[name][0].shape))

    def step(self, compute: Callable[[SchedulerOutput], None] | None = None) -> SchedulerOutput:
        """One engine step with the pattern-writing model (or ``compute``), recording each request's GPU blocks."""
        model = self._compute if compute is None else compute

        def seen_then_model(output: SchedulerOutput) -> None:
            for request_id in self.scheduler.requests:
                self.gpu_blocks_seen[request_id] = self.gpu_blocks(request_id)
            model(output)

        return super().step(seen_then_model)

    def step_until(self, done: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
        """Step with short sleeps until ``done()``: the fs tier answers lookups and copies on its own threads."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
            self.step()
            time.sleep(0.005)

    def serve(self, request_id: str, prompt: list[int]) -> None:
        """Add a request and step until it finished and every transfer it caused (stores, cascades) completed."""
        self.scheduler.add_request(make_request(request_id, prompt))
        self.step_until(lambda: request_id not in self.scheduler.requests, f"{request_id} finished")
        self.step_until(
            lambda: self.cpu.stats().pending == 0 and not self.tiering.has_pending_work(), "transfers drained"
        )


def start_tiered_vllm(
    config: ModelConfig, extra_config: dict[str, object], *, world_size: int = 1, engine_id: str | None = None
) -> TieredVLLM:
    """A scheduler (seeing ``world_size`` ranks) and ``world_size`` worker-side connectors sharing one region."""
    spec = kv_spec(world_size)
    kvs: list[dict[str, torch.Tensor]] = []

    def layer_caches(rank: int) -> dict[str, torch.Tensor]:
        # FlashInfer-style (num_blocks, 2, block_size, heads, dim) layer caches, as a CPU "GPU".
        del rank
        kv = {
            name: torch.zeros(NUM_GPU_BLOCKS, 2, BLOCK_SIZE, spec.num_kv_heads, HEAD_SIZE, dtype=torch.float16)
            for name in LAYERS
        }
        kvs.append(kv)
        return kv

    scheduler, workers = start_in_process_vllm(
        config,
        {**TIERING_SPEC, **extra_config},
        [KVCacheGroupSpec(list(LAYERS), spec)],
        layer_caches,
        world_size=world_size,
        engine_id=engine_id or f"tiering-test-{uuid.uuid4().hex[:12]}",
    )
    return TieredVLLM(scheduler=scheduler, workers=workers, aggregator=KVOutputAggregator(world_size), kvs=kvs)
