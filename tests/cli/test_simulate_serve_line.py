"""The `vllm serve` line `kvtriton simulate` prints starts the server it modelled, read by vLLM's own parser.

Each case runs the command, takes the printed line as a shell would (its
backslash-newline joined), and parses it with the parser of vLLM's
``vllm serve`` subcommand into vLLM's ``EngineArgs``. Every setting the model
ran with, given or defaulted, must come out of vLLM's parser as the model's
value: the server model's knobs as the JSON record's ``call_order`` holds them,
and the record's ``engine_args``. vLLM is parsed in one child process for every
case: its parser needs a platform, and ``VLLM_TARGET_DEVICE=cpu`` there must not
leak into this process's vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest

from kvtriton.cli._main import main
from kvtriton.sim import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, EngineSettings
from tests.cli.conftest import SMALL

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (make test installs it from requirements-vllm.txt)",
)

_SETTINGS = [field.name for field in fields(EngineSettings)]

_PARSE_WITH_VLLM = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
names, commands = json.load(sys.stdin)
parsed = []
for argv in commands:
    args = parser.parse_args(argv)
    args.model = args.model_tag  # what `vllm serve` does with its positional model
    engine = AsyncEngineArgs.from_cli_args(args)
    transfer = engine.kv_transfer_config
    parsed.append({
        **{name: getattr(engine, name) for name in names},
        "model": engine.model,
        "kv_connector": transfer.kv_connector,
        "kv_connector_extra_config": transfer.kv_connector_extra_config,
    })
json.dump(parsed, sys.stdout)
"""


def parse_with_vllm(commands: list[list[str]]) -> list[dict[str, Any]]:
    """Each ``vllm serve`` argv (without ``vllm``) parsed by vLLM 0.33's own serve parser into its EngineArgs."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu")}
    done = subprocess.run(
        [sys.executable, "-c", _PARSE_WITH_VLLM],
        input=json.dumps([_SETTINGS, commands]),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def serve_argv(printed: str) -> list[str]:
    """The printed ``vllm serve`` command as a shell reads it: from ``vllm serve`` to its last continued line."""
    lines = printed.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("vllm serve "))
    end = start
    while lines[end].endswith("\\"):
        end += 1
    words = shlex.split("\n".join(lines[start : end + 1]).replace("\\\n", ""))
    assert words[:2] == ["vllm", "serve"]
    return words[1:]


@dataclass(frozen=True)
class Case:
    name: str
    flags: list[str]
    record: str
    """The JSON record's file name."""


TIERED = [*SMALL, "--gpu-blocks", "120", "--tier", "fs", "--capacities", "1,4", "--target-hit-rate", "0.01"]
HOST = [*SMALL, "--capacities", "1,4", "--target-hit-rate", "0.01"]
GIVEN = ["--max-num-seqs", "4", "--max-num-batched-tokens", "1024", "--tensor-parallel-size", "2", "--sync-loads"]

CASES = [
    Case(
        "host, vLLM's order, every setting defaulted", [*HOST, "--call-order", "vllm"], "simulate-system-prompts.json"
    ),
    Case("host, every setting given", [*HOST, "--gpu-blocks", "120", *GIVEN], "simulate-system-prompts.json"),
    Case(
        "host, a token budget below the default max_num_seqs",
        [*HOST, "--call-order", "vllm", "--max-num-batched-tokens", "128"],
        "simulate-system-prompts.json",
    ),
    Case("host, kvtriton's order (no scheduler modelled)", HOST, "simulate-system-prompts.json"),
    Case("tiered, every setting defaulted but the GPU cache", TIERED, "simulate-system-prompts-tiered.json"),
    Case("tiered, every setting given", [*TIERED, *GIVEN], "simulate-system-prompts-tiered.json"),
]


def test_the_printed_line_parsed_by_vllm_is_the_server_the_model_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outputs: list[tuple[Case, dict[str, Any], list[str]]] = []
    for index, case in enumerate(CASES):
        out = tmp_path / str(index)
        assert main(["simulate", *case.flags, "--out", str(out)]) == 0, case.name
        record = json.loads((out / case.record).read_text())
        assert record["recommendation"]["reached"], case.name
        outputs.append((case, record, serve_argv(capsys.readouterr().out)))
    parsed = parse_with_vllm([argv for _, _, argv in outputs])

    for (case, record, _), engine in zip(outputs, parsed):
        settings: dict[str, Any] = record["engine_args"]
        assert set(settings) == set(_SETTINGS), case.name
        for name, value in settings.items():
            if value is not None:  # None: not modelled (kvtriton's order), left to vLLM
                assert engine[name] == value, f"{case.name}: {name}"
        extra = record["recommendation"]["kv_connector_extra_config"]
        assert (engine["model"], engine["kv_connector"]) == ("<model>", "OffloadingConnector"), case.name
        assert engine["kv_connector_extra_config"] == extra, case.name
        order = record["call_order"]
        if order["name"] != "vllm":
            assert settings["max_num_seqs"] is None and settings["max_num_batched_tokens"] is None, case.name
            continue
        # The server model's own knobs, as the replay ran them, are what vLLM's parser read.
        ran = {
            "max_num_seqs": order["max_num_seqs"],
            "max_num_batched_tokens": order["max_num_batched_tokens"],
            "num_gpu_blocks_override": order["gpu_blocks"],
            "enable_prefix_caching": order["gpu_blocks"] is not None,
            "block_size": 32,
            "enable_chunked_prefill": True,
            "async_scheduling": False,
        }
        assert {name: engine[name] for name in ran} == ran, case.name

    by_name = {case.name: engine for (case, _, _), engine in zip(outputs, parsed)}
    defaulted = by_name["host, vLLM's order, every setting defaulted"]
    assert (defaulted["max_num_batched_tokens"], defaulted["max_num_seqs"]) == (
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        DEFAULT_MAX_NUM_SEQS,
    )
    assert (defaulted["enable_prefix_caching"], defaulted["num_gpu_blocks_override"]) == (False, None)
    assert by_name["host, a token budget below the default max_num_seqs"]["max_num_seqs"] == 128
    for given in ("host, every setting given", "tiered, every setting given"):
        engine = by_name[given]
        assert (engine["max_num_seqs"], engine["max_num_batched_tokens"], engine["tensor_parallel_size"]) == (
            4,
            1024,
            2,
        )
        assert (engine["enable_prefix_caching"], engine["num_gpu_blocks_override"]) == (True, 120)
        # --sync-loads: vLLM loads within the step up to its budget, which the model leaves unlimited.
        budget = engine["kv_connector_extra_config"]["sync_load_budget_bytes"]
        assert budget >= 4 * engine["kv_connector_extra_config"]["cpu_bytes_to_use"]
    assert "sync_load_budget_bytes" not in defaulted["kv_connector_extra_config"]


def test_max_num_seqs_above_the_token_budget_is_refused_as_vllm_refuses_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert (
        main(["simulate", *HOST, "--max-num-seqs", "300", "--max-num-batched-tokens", "256", "--out", str(tmp_path)])
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        "kvtriton simulate: error: --max-num-seqs 300 is more than --max-num-batched-tokens 256, which vLLM refuses:"
        " lower --max-num-seqs or raise --max-num-batched-tokens"
    )
    assert main(["simulate", *HOST, "--max-num-seqs", "4096", "--out", str(tmp_path)]) == 2
    assert "--max-num-seqs 4096 is more than --max-num-batched-tokens 2048 (its default)" in capsys.readouterr().err
