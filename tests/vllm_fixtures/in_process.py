"""vLLM's own Scheduler and OffloadingConnector in this process, with kvtriton's spec, stepped by hand on CPU.

Only the model is simulated: a test passes the step a ``compute`` callback
that writes the KV blocks of the tokens scheduled. Several worker ranks
(tensor parallelism) are several worker-side connectors whose outputs are
combined by vLLM's own ``KVOutputAggregator``. vLLM derives the rank and
world size from its parallel config, which a CPU test cannot set to two
ranks, so :func:`start_in_process_vllm` overrides exactly those two fields of
the ``OffloadingConfig`` each connector builds (:func:`parallel_as`), and
the number of workers whose completions the scheduler side waits for; vLLM's
parallel groups, which vLLM 0.34 asks whether the workers share a node before
it allows secondary tiers, say that they do (:func:`workers_on_nodes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import vllm.distributed.parallel_state as parallel_state
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.config.cache import CacheDType
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector as connector_module
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

from kvtriton.worker._slab import PageableSlabWarning
from vllm_fixtures.builders import TINY_MODEL_DIR
from vllm_fixtures.requests import EOS

_OUTPUT_HAS_REQUEST_INDEX = "req_id_to_index" in {field.name for field in dataclasses.fields(ModelRunnerOutput)}
"""vLLM 0.33's ModelRunnerOutput takes a request-id index; 0.34 dropped it (the order of req_ids is the index)."""


def model_runner_output(req_ids: list[str], **fields: Any) -> ModelRunnerOutput:
    """A ``ModelRunnerOutput`` for ``req_ids`` on either release: with 0.33's request-id index where it has one."""
    if _OUTPUT_HAS_REQUEST_INDEX:
        fields["req_id_to_index"] = {req_id: index for index, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


__all__ = [
    "BLOCK_SIZE",
    "NUM_GPU_BLOCKS",
    "InProcessVLLM",
    "cpu_vllm_config",
    "model_runner_output",
    "new_scheduler",
    "offloading_manager",
    "parallel_as",
    "start_in_process_vllm",
    "tiny_model_config",
    "workers_on_nodes",
]

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 32

_Manager = TypeVar("_Manager")


def tiny_model_config() -> ModelConfig:
    """vLLM's ModelConfig of the config-only tiny Llama (the slow part: vLLM inspects the model class once)."""
    return ModelConfig(model=str(TINY_MODEL_DIR), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=1024)


@contextlib.contextmanager
def parallel_as(rank: int, world_size: int) -> Generator[None]:
    """Make the connectors built inside see ``rank`` of ``world_size`` (see the module docstring)."""
    # The connector module's own binding is patched (it imported the function by name).
    real: Callable[..., Any] = getattr(connector_module, "build_offloading_config")

    def build(*args: Any, **kwargs: Any) -> Any:
        config = real(*args, **kwargs)
        return dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, rank=rank, world_size=world_size)
        )

    setattr(connector_module, "build_offloading_config", build)
    try:
        yield
    finally:
        setattr(connector_module, "build_offloading_config", real)


class _ParallelGroup:
    """A parallel group as vLLM's check of workers across nodes reads it: its size and its CPU process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.cpu_group = object()


@contextlib.contextmanager
def workers_on_nodes(nodes: Sequence[int]) -> Generator[list[object]]:
    """Make vLLM's parallel state say the tensor-parallel workers run on ``nodes`` (one entry per rank: its node).

    The pipeline and context-parallel groups have one rank. vLLM 0.34 reads
    these groups when it refuses secondary tiers on workers across nodes
    (``in_the_same_node_as``, a collective in a real engine); the ranks of an
    in-process engine have no process groups, and share this one node.
    Yields the groups the check asked about.
    """
    tensor_parallel, single = _ParallelGroup(len(nodes)), _ParallelGroup(1)
    asked: list[object] = []

    def in_the_same_node_as(group: object, source_rank: int = 0) -> list[bool]:
        asked.append(group)
        return [node == nodes[source_rank] for node in nodes]

    patched: dict[str, object] = {
        "get_tp_group": lambda: tensor_parallel,
        "get_pp_group": lambda: single,
        "get_pcp_group": lambda: single,
        "in_the_same_node_as": in_the_same_node_as,
    }
    real = {name: getattr(parallel_state, name) for name in patched}
    for name, value in patched.items():
        setattr(parallel_state, name, value)
    try:
        yield asked
    finally:
        for name, value in real.items():
            setattr(parallel_state, name, value)


def _no_model(output: SchedulerOutput) -> None:
    del output


@dataclass(kw_only=True)
class InProcessVLLM:
    """vLLM's scheduler and one worker-side connector per rank, stepped by hand."""

    scheduler: Scheduler
    workers: list[OffloadingConnector]
    aggregator: KVOutputAggregator
    load_jobs: list[int] = field(default_factory=lambda: [])
    """Every load job the scheduler side handed the workers, in order."""
    store_jobs: list[int] = field(default_factory=lambda: [])
    """Every store job the scheduler side handed the workers, in order."""

    def gpu_blocks(self, request_id: str, group: int = 0) -> list[int]:
        """``request_id``'s GPU blocks in ``group`` (0: the null block, e.g. outside a sliding window)."""
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[group])

    def step(self, compute: Callable[[SchedulerOutput], None] = _no_model) -> SchedulerOutput:
        """One engine step: schedule, every rank's connector around the simulated forward ``compute``, update."""
        output = self.scheduler.schedule()
        metadata = output.kv_connector_metadata
        assert isinstance(metadata, OffloadingConnectorMetadata)
        self.load_jobs += list(metadata.load_jobs)
        self.store_jobs += list(metadata.store_jobs)
        for worker in self.workers:
            worker.handle_preemptions(metadata)  # the model runner's first connector call of a step
            worker.bind_connector_metadata(metadata)
            worker.start_load_kv(None)  # pyright: ignore[reportArgumentType] -- the offloading connector ignores the forward context
        compute(output)
        running = self.scheduler.running
        rank_outputs: list[ModelRunnerOutput | None] = []
        for worker in self.workers:
            if output.total_num_scheduled_tokens > 0:
                worker.wait_for_save()
            sending, receiving = worker.get_finished(output.finished_req_ids)
            worker_meta = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            rank_outputs.append(
                model_runner_output(
                    [request.request_id for request in running],
                    sampled_token_ids=[[EOS] for _ in running],
                    kv_connector_output=KVConnectorOutput(
                        finished_sending=sending, finished_recving=receiving, kv_connector_worker_meta=worker_meta
                    ),
                )
            )
        combined = self.aggregator.aggregate(rank_outputs)
        assert combined is not None
        self.scheduler.update_from_output(output, combined)
        return output

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()


def cpu_vllm_config(
    model_config: ModelConfig,
    extra_config: Mapping[str, object],
    *,
    block_size: int = BLOCK_SIZE,
    cache_dtype: CacheDType = "auto",
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 256,
    engine_id: str | None = None,
) -> VllmConfig:
    """An engine on CPU with chunked prefill and prefix caching, vLLM's OffloadingConnector given ``extra_config``
    (the whole ``kv_connector_extra_config``); ``engine_id`` None: vLLM draws one."""
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=block_size, cache_dtype=cache_dtype, gpu_memory_utilization=0.9, enable_prefix_caching=True
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config=dict(extra_config),
        ),
        device_config=DeviceConfig("cpu"),
    )


def new_scheduler(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, scheduler_class: type[Scheduler] = Scheduler
) -> Scheduler:
    """vLLM's ``scheduler_class`` over the GPU blocks of ``kv_cache_config``, logging stats."""
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return scheduler_class(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
    )


def offloading_manager(scheduler: Scheduler, kind: type[_Manager]) -> _Manager:
    """The manager, a ``kind``, that vLLM's OffloadingConnector drives on ``scheduler``'s side."""
    connector = scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    manager = connector.scheduler.manager
    assert isinstance(manager, kind)
    return manager


def start_in_process_vllm(
    model_config: ModelConfig,
    extra_config: Mapping[str, object],
    kv_cache_groups: list[KVCacheGroupSpec],
    layer_caches: Callable[[int], dict[str, torch.Tensor]],
    *,
    world_size: int = 1,
    engine_id: str | None = None,
) -> tuple[Scheduler, list[OffloadingConnector]]:
    """vLLM's scheduler (seeing ``world_size`` ranks) and one worker-side connector per rank.

    ``extra_config`` is the whole ``kv_connector_extra_config`` (the spec's
    name and module included); ``layer_caches(rank)`` gives the layer caches
    a rank's connector registers (the CPU "GPU").
    """
    vllm_config = cpu_vllm_config(
        model_config, extra_config, engine_id=engine_id or f"in-process-{uuid.uuid4().hex[:12]}"
    )
    kv_cache_config = KVCacheConfig(num_blocks=NUM_GPU_BLOCKS, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups)
    with parallel_as(0, world_size):
        scheduler = new_scheduler(vllm_config, kv_cache_config)
    connector = scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    # The scheduler side counts one completion per worker of its parallel config (1 here).
    connector.scheduler.config = connector.scheduler.config._replace(num_workers=world_size)
    workers: list[OffloadingConnector] = []
    for rank in range(world_size):
        # As vLLM's worker does: its connector is built and registered under the current config (the engine
        # core's scheduler above is not). The ranks run on this one node (vLLM 0.34 asks before it allows
        # secondary tiers).
        with set_current_vllm_config(vllm_config), workers_on_nodes([0] * world_size), warnings.catch_warnings():
            with parallel_as(rank, world_size):
                worker = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
            warnings.simplefilter("ignore", PageableSlabWarning)
            worker.register_kv_caches(layer_caches(rank))
        workers.append(worker)
    return scheduler, workers
