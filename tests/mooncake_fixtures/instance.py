"""One serving instance in its own process: vLLM's scheduler + OffloadingConnector + kvtriton's tiered spec + the Mooncake tier.

Run as ``python -m mooncake_fixtures.instance MASTER NAMESPACE BLOCKS_PER_CHUNK OUT_JSON [GO_FILE]``
(with tests/ on PYTHONPATH). The instance has a private, empty primary. Once
built and connected it waits for GO_FILE to exist, if one is named (so a test
can start every instance at once and release them in order), then
serves :data:`PROMPT` once, waits until every chunk it stored has cascaded to
Mooncake, and writes what happened to OUT_JSON: which prompt blocks the model
computed, the bytes of the prompt's GPU blocks after the request (hex, per
layer), how many load jobs ran, and the Mooncake tier's counters. The test
compares the bytes with the model's known pattern.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import uuid
from pathlib import Path

from tiering_fixtures.tiered_vllm import BLOCK_SIZE, LAYERS, TieredVLLM, kv_spec, start_tiered_vllm
from vllm_fixtures.in_process import tiny_model_config
from vllm_fixtures.requests import make_request

from kvtriton.integrations.mooncake import MooncakeStoreTier

PROMPT = list(range(900, 900 + 4 * BLOCK_SIZE + 5))
"""4 full blocks and a partial one."""
FULL_BLOCKS = 4
GO_TIMEOUT_S = 180.0


def mooncake_tier(engine: TieredVLLM) -> MooncakeStoreTier:
    (tier,) = engine.tiering.secondary_tiers
    assert isinstance(tier, MooncakeStoreTier)
    return tier


def serve(master: str, namespace: str, blocks_per_chunk: int, go_file: Path | None) -> dict[str, object]:
    chunk = blocks_per_chunk * kv_spec(1).page_size_bytes * len(LAYERS)
    extra: dict[str, object] = {
        "cpu_bytes_to_use": 16 * -(-chunk // 4096) * 4096,
        "blocks_per_chunk": blocks_per_chunk,
        "secondary_tiers": [
            {
                "type": "MooncakeStoreTier",
                "module_path": "kvtriton.integrations.mooncake",
                "master_server_address": master,
                "namespace": namespace,
                "timeout_s": 5.0,
                "io_threads": 2,
            }
        ],
    }
    engine = start_tiered_vllm(tiny_model_config(), extra, engine_id=f"mooncake-instance-{uuid.uuid4().hex[:8]}")
    try:
        tier = mooncake_tier(engine)
        assert tier.wait_until_up(15.0), "the tier never reached the master"
        deadline = time.monotonic() + GO_TIMEOUT_S
        while go_file is not None and not go_file.exists():
            assert time.monotonic() < deadline, f"{go_file} never appeared"
            time.sleep(0.05)
        engine.scheduler.add_request(make_request("prompt", PROMPT))
        gpu_blocks: list[int] = []

        def finished() -> bool:
            if not gpu_blocks and engine.scheduler.requests.get("prompt") is not None:
                blocks = engine.gpu_blocks("prompt")
                if len(blocks) >= FULL_BLOCKS:
                    gpu_blocks.extend(blocks[:FULL_BLOCKS])
            return "prompt" not in engine.scheduler.requests

        engine.step_until(finished, "the prompt was served")
        engine.step_until(
            lambda: not engine.tiering.has_pending_work() and engine.cpu.stats().pending == 0, "cascades done"
        )
        deadline = time.monotonic() + 15.0
        while tier.stats().stored_keys < FULL_BLOCKS // blocks_per_chunk and tier.stats().loaded_keys == 0:
            assert time.monotonic() < deadline, f"chunks never reached Mooncake: {tier.stats()}"
            engine.step()
            time.sleep(0.01)
        stats = tier.stats()
        return {
            "computed": [index for request, index in engine.computed if request == "prompt"],
            "blocks": [[data.hex() for data in engine.block_bytes(0, block)] for block in gpu_blocks],
            "load_jobs": len(engine.load_jobs),
            "digest": tier.keyspace.digest,
            "stats": {key: value for key, value in dataclasses.asdict(stats).items() if key != "state"},
        }
    finally:
        engine.shutdown()


def main(argv: list[str]) -> int:
    master, namespace, blocks_per_chunk, out, *go = argv
    report = serve(master, namespace, int(blocks_per_chunk), Path(go[0]) if go else None)
    Path(out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
