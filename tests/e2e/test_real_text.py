"""Real text through a real model: SmolLM2-135M's chat prompts come back from kvtriton's slab and from disk, exactly.

The engines are ``real_text``'s (conftest.py, :mod:`e2e.real_text`): kvtriton's
host slab in front of vLLM's ``fs`` tier, and a fresh engine on the same fs
root. The reference is the same batch served from vLLM's own prefix cache
(``local``): the same cached prefix, the same schedule, so the tokens must
be equal to the last one.
"""

from __future__ import annotations

from bench.real_model import PreparedModel
from e2e.engine import HITS, LOADED, STORED
from e2e.real_text import BLOCK_SIZE, REAL_TEXT_PROMPTS, RealTextRuns, distinct_full_blocks

WRITTEN = "vllm:kv_offload_tiering_write_bytes"
READ = "vllm:kv_offload_tiering_read_bytes"


def _tokens(run: RealTextRuns, engine: str, step: str) -> list[list[int]]:
    return [completion.token_ids for completion in getattr(run, engine).step(step).completions]


def test_prefix_from_kvtritons_slab_gives_the_tokens_of_vllms_own_prefix_cache(
    real_text: RealTextRuns, smollm2: PreparedModel
) -> None:
    run = real_text.tiered
    prompts = smollm2.chat_prompts[:REAL_TEXT_PROMPTS]
    blocks = distinct_full_blocks(prompts)
    assert run.delta("cold", HITS) == 0
    assert run.delta("cold", STORED) == blocks * run.kv_bytes_per_block > 0, "a block the prompts share is stored once"
    assert run.delta("warm", HITS) == blocks * BLOCK_SIZE, "every full block is an external hit"
    assert [c.num_cached_tokens for c in run.step("warm").completions] == [
        len(p) // BLOCK_SIZE * BLOCK_SIZE for p in prompts
    ]
    assert run.delta("warm", LOADED) == run.delta("cold", STORED), "the bytes loaded are the bytes stored"
    assert run.delta("warm", STORED) == 0, "nothing new to store"
    assert _tokens(real_text, "tiered", "warm") == _tokens(real_text, "tiered", "local")


def test_a_fresh_engine_gets_the_prefix_from_disk_and_the_same_tokens(
    real_text: RealTextRuns, smollm2: PreparedModel
) -> None:
    writer, reader = real_text.tiered, real_text.disk
    blocks = distinct_full_blocks(smollm2.chat_prompts[:REAL_TEXT_PROMPTS])
    assert writer.delta("cold", WRITTEN) == blocks * writer.tier_chunk_bytes, "every block stored went to disk too"
    assert writer.delta("cold", STORED) == blocks * writer.kv_bytes_per_block
    assert sum(path.stat().st_size for path in real_text.fs_root.rglob("*.bin")) >= writer.delta("cold", WRITTEN)
    assert reader.delta("disk", HITS) == blocks * BLOCK_SIZE, "every full block is an external hit"
    assert reader.delta("disk", READ) == writer.delta("cold", WRITTEN), "the bytes read are the bytes written"
    assert reader.delta("disk", LOADED) == writer.delta("cold", STORED)
    assert _tokens(real_text, "disk", "disk") == _tokens(real_text, "tiered", "local")
