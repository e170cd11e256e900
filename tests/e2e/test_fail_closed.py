"""Real engines fail closed behind kvtriton's tiered spec: a damaged or foreign fs chunk is a miss, never wrong tokens.

Six engine processes share the work (an engine start is the slow part):

* the writer (the tiny Llama at a path of this module's own) computes one
  prompt per case with nothing to load, so its tokens are that model's own
  reference, and cascades every full block to an fs root;
* the damaged reader runs on a copy of that root in which each prompt's chunk
  files took one kind of damage, and generates every prompt again;
* an engine per setting that changes the KV bytes (the dtype, the block size,
  the compression) runs the intact prompt on the writer's root;
* the re-deployed reader runs on the writer's root after other weights were
  written to the same model path (a fine-tune copied over the old one).

Each case ends with the engine alive (it generated every prompt, in order,
and exited cleanly), the writer's tokens, and the fault either counted in
``vllm:kv_offload_integrity_failures`` with a WARNING naming its reason, or
a plain miss in another directory (another identity).
"""

from __future__ import annotations

import dataclasses
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import xxhash

from bench.tiny_models import TinyLlama
from e2e.engine import HITS, EngineJob, EngineResult, generate, run_engine, spec_config
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS
from kvtriton._integrity import SEAL_BYTES

FAULTS = "vllm:kv_offload_integrity_failures"
FULL_BLOCKS = 4
SEAL_FIELDS = struct.Struct("<16s16sQI4s")
"""The seal's fields after its checksum (kvtriton/_integrity.py): fingerprint, key digest, length, version, magic."""
CHECKSUM_BYTES = 16


def prompt(case: int) -> list[int]:
    """Four full blocks and a partial one, sharing no block with another case's prompt."""
    start = 10 + 140 * case
    return list(range(start, start + FULL_BLOCKS * BLOCK_SIZE + 5))


def older_row_format(data: bytes) -> bytes:
    """The chunk as a kvtriton of the previous row format would have sealed it: its seal intact, its version one less."""
    payload, trailer = data[:-SEAL_BYTES], data[-SEAL_BYTES:]
    fingerprint, key, length, version, magic = SEAL_FIELDS.unpack(trailer[CHECKSUM_BYTES:])
    fields = SEAL_FIELDS.pack(fingerprint, key, length, version - 1, magic)
    checksum = xxhash.xxh3_128(payload)
    checksum.update(fields)
    return payload + checksum.digest() + fields


def flip_middle(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(byte ^ 0xFF for byte in data[middle : middle + 64]) + data[middle + 64 :]


@dataclass(frozen=True)
class Case:
    """One prompt's chunk files, damaged in one way, and how the damaged reader must end."""

    name: str
    damage: Callable[[list[Path]], None]
    """Damages the prompt's chunk files (in the order the writer wrote them)."""
    reason: str | None
    """The integrity fault counted and warned about; None when nothing reaches kvtriton's check."""
    hits: bool
    """Whether the prefix is still loaded from the tier (only the intact files are)."""
    rewritten: int = FULL_BLOCKS
    """How many of the prompt's files the reader rejects, and so writes afresh: a file whose length is wrong is
    rejected as the lookup reaches it, and the lookup stops at that first miss (the next request reaches the next)."""


def _each(change: Callable[[bytes], bytes]) -> Callable[[list[Path]], None]:
    def damage(files: list[Path]) -> None:
        for path in files:
            path.write_bytes(change(path.read_bytes()))

    return damage


def _rotate(files: list[Path]) -> None:
    """Each file takes the bytes of the next one: every key holds another key's intact chunk."""
    contents = [path.read_bytes() for path in files]
    for path, content in zip(files, contents[1:] + contents[:1], strict=True):
        path.write_bytes(content)


CASES = [
    Case("flipped-bytes", _each(flip_middle), "checksum", hits=False),
    Case("another-keys-file", _rotate, "other_key", hits=False),
    Case("older-row-format", _each(older_row_format), "stale_format", hits=False),
    # Files of another length: caught before vLLM's fs tier reads them (its own short read would go uncounted,
    # and it never reads past one chunk).
    Case("truncated", _each(lambda data: data[: len(data) // 2]), "torn", hits=False, rewritten=1),
    Case("empty", _each(lambda data: b""), "torn", hits=False, rewritten=1),
    Case("over-long", _each(lambda data: data + b"\xff" * 4096), "wrong_size", hits=False, rewritten=1),
    Case("intact", _each(lambda data: data), None, hits=True),
]


@dataclass(frozen=True)
class OtherIdentity:
    """An engine of the writer's model whose KV bytes differ by one setting: it must not read the writer's chunks."""

    name: str
    job: dict[str, object] = field(default_factory=dict[str, object])
    """EngineJob fields that differ from the writer's."""
    spec: dict[str, object] = field(default_factory=dict[str, object])
    """kv_connector_extra_config keys that differ from the writer's."""


OTHER_IDENTITIES = [
    OtherIdentity("another-dtype", job={"dtype": "bfloat16"}),
    OtherIdentity("another-block-size", job={"block_size": 2 * BLOCK_SIZE}),  # vLLM CPU: a multiple of 32
    OtherIdentity("another-compression", spec={"kvtriton_kv_compression": "fp8-e4m3"}),
]


def tiered_engine(
    model: Path, root: Path, workdir: Path, cases: list[Case] = CASES, other: OtherIdentity | None = None
) -> EngineResult:
    config = spec_config(
        "KVTritonTieringOffloadingSpec",
        cpu_bytes_to_use=8 << 20,
        secondary_tiers=[{"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2}],
        **(other.spec if other else {}),
    )
    steps = [generate(prompt(CASES.index(case)), MAX_TOKENS, case.name) for case in cases]
    job = EngineJob(model=str(model), steps=steps, kv_transfer_config=config)
    return run_engine(dataclasses.replace(job, **(other.job if other else {})), workdir)


def chunk_files(root: Path) -> list[Path]:
    """Every chunk file under ``root``, in the order they were written (the writer ran one prompt after another)."""
    return sorted(root.rglob("*.bin"), key=lambda path: path.stat().st_mtime_ns)


@dataclass(frozen=True)
class Runs:
    writer: EngineResult
    damaged: EngineResult
    redeployed: EngineResult
    written_root: Path
    damaged_root: Path
    damaged_files: list[Path]
    """The damaged root's chunk files, in the writer's order: case ``i`` took files ``4 i .. 4 i + 3``."""
    others: dict[str, EngineResult]
    """Each of OTHER_IDENTITIES' engines, run on the writer's root with the intact prompt."""


@pytest.fixture(scope="module")
def runs(e2e_dir: Path) -> Runs:
    model = TinyLlama().write(e2e_dir / "fail-closed-llama")
    written_root = e2e_dir / "fail-closed-fs"
    writer = tiered_engine(model, written_root, e2e_dir / "fail-closed-writer")
    files = chunk_files(written_root)
    assert len(files) == FULL_BLOCKS * len(CASES), files
    assert {path.stat().st_size for path in files} == {writer.tier_chunk_bytes}

    damaged_root = e2e_dir / "fail-closed-fs-damaged"
    shutil.copytree(written_root, damaged_root)
    damaged_files = chunk_files(damaged_root)  # copytree keeps each file's mtime, hence the order
    assert [path.relative_to(damaged_root) for path in damaged_files] == [
        path.relative_to(written_root) for path in files
    ]
    for index, case in enumerate(CASES):
        case.damage(damaged_files[index * FULL_BLOCKS : (index + 1) * FULL_BLOCKS])
    damaged = tiered_engine(model, damaged_root, e2e_dir / "fail-closed-damaged")
    intact = [case for case in CASES if case.name == "intact"]
    others = {
        other.name: tiered_engine(model, written_root, e2e_dir / f"fail-closed-{other.name}", intact, other)
        for other in OTHER_IDENTITIES
    }

    TinyLlama().write(model, seed=1)  # other weights at the same path
    redeployed = tiered_engine(model, written_root, e2e_dir / "fail-closed-redeployed")
    return Runs(writer, damaged, redeployed, written_root, damaged_root, damaged_files, others)


def test_the_writer_computes_every_prompt_and_cascades_every_full_block(runs: Runs) -> None:
    for case in CASES:
        assert runs.writer.delta(case.name, HITS) == 0  # computed: the model's own reference tokens
        assert runs.writer.delta(case.name, FAULTS) == 0
    assert len({tuple(runs.writer.step(case.name).token_ids) for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_damaged_chunk_file_ends_with_the_models_own_tokens_and_the_fault_counted(runs: Runs, case: Case) -> None:
    served = runs.damaged.step(case.name)
    assert served.token_ids == runs.writer.step(case.name).token_ids
    if case.hits:
        assert runs.damaged.delta(case.name, HITS) == FULL_BLOCKS * BLOCK_SIZE
    else:
        assert runs.damaged.delta(case.name, HITS) == 0
    if case.reason is None:
        assert runs.damaged.delta(case.name, FAULTS) == 0
        return
    assert runs.damaged.delta(case.name, FAULTS) >= 1
    assert f"kvtriton integrity: tier 1:fs: chunk {runs.damaged_root}" in runs.damaged.log
    assert f"(reason {case.reason}:" in runs.damaged.log


def test_the_damaged_reader_survives_every_fault_and_rewrites_the_files_that_failed_their_check(runs: Runs) -> None:
    assert [step.name for step in runs.damaged.steps] == [case.name for case in CASES]  # alive to the last prompt
    chunk_bytes = runs.writer.tier_chunk_bytes
    for index, case in enumerate(CASES):
        if case.reason is None:
            continue  # intact: left as it was
        files = runs.damaged_files[index * FULL_BLOCKS : (index + 1) * FULL_BLOCKS]
        # Removed when it failed, then written afresh by the cascade of the recomputed chunk: whole again. The
        # others keep the length the damage left them (files written in one clock tick share their mtime, so
        # which of the four is first in the prompt is not known here).
        sizes = [path.stat().st_size for path in files]
        assert sizes.count(chunk_bytes) == case.rewritten, (case.name, sizes)


def test_other_weights_at_the_same_path_are_another_identity_a_plain_miss_in_another_directory(runs: Runs) -> None:
    for case in CASES:
        assert runs.redeployed.delta(case.name, HITS) == 0
        assert runs.redeployed.delta(case.name, FAULTS) == 0  # nothing of the old model was read
    # Its own tokens (nothing was loaded), which are not the old model's.
    assert runs.redeployed.step("intact").token_ids != runs.writer.step("intact").token_ids
    namespaces = {path.name.removesuffix("_r0") for path in runs.written_root.iterdir()}
    assert len(namespaces) == 2 + len(OTHER_IDENTITIES), namespaces  # the writer's, the others', the redeployed's
    identities = [line for line in runs.redeployed.log.splitlines() if "kvtriton tiered offloading identity" in line]
    assert identities and identities[0] not in runs.writer.log


@pytest.mark.parametrize("other", OTHER_IDENTITIES, ids=[other.name for other in OTHER_IDENTITIES])
def test_an_engine_whose_kv_bytes_differ_by_one_setting_plainly_misses_the_writers_chunks(
    runs: Runs, other: OtherIdentity
) -> None:
    run = runs.others[other.name]
    assert [step.name for step in run.steps] == ["intact"]  # alive
    assert run.delta("intact", HITS) == 0  # computed: its own tokens
    assert run.delta("intact", FAULTS) == 0  # another identity, another directory: nothing of the writer's read
    identities = [line for line in run.log.splitlines() if "kvtriton tiered offloading identity" in line]
    assert identities and identities[0] not in runs.writer.log
