"""What fp8-e4m3 compression of offloaded KV costs in accuracy, and what it saves in bytes.

Run ``python -m bench.compression`` (``--quick`` for a smoke run). On
synthetic KV shaped like one Llama-3-8B layer (8 KV heads x 128 dims, 16-token
blocks, bf16) with realistic outliers -- K has a few channels 10-30x larger
than the rest, the same channels in every token (what rotary K caches show),
and a per-token magnitude spread; V is closer to normal with rarer outlier
channels -- it reports, side by side for

* ``group fp8``: kvtriton's format (one fp32 scale per group of G contiguous
  elements, G = the head dimension = 128 by default, and G = 32),
* ``per-tensor fp8``: one scale for the whole tensor (what an fp8 KV cache in
  vLLM does: ``kv_cache_dtype="fp8_e4m3"`` with a per-tensor scale),

the per-element error of K and V (relative RMS error, largest error relative
to the tensor's RMS, and the share of elements whose error exceeds the
issue's bound ``2^-4 |x| + scale 2^-9``) and the relative error of attention
outputs (``softmax(q K^T / sqrt(d)) V`` for random queries over every cached
token, each head; the queries scaled so that the logits have a standard
deviation of 2) against the uncompressed cache. It also reports the bytes
one block moves and holds, from the format (bf16, fp16, fp32 pages) and from
a real store job of the CPU transfer engine (its ``transfer_size``).

It then runs the end-to-end tests' tiny Llama (``bench/tiny_models.py``:
random weights, 2 layers, 2 KV heads of 32, run in bf16 as the compressed
end-to-end test runs it) through transformers on random prompts: a prefix of
4 blocks of 32 tokens is cached, its K and V replaced by each scheme's
decoded values (what a load from a compressed slab writes back), then the
rest of the prompt and 6 greedy tokens of the exact run are fed
(teacher-forced, so every position sees the same context). Per scheme: the K
and V errors over the cached prefix, the relative error of every layer's
attention output over the fed positions, and of the next-token
distributions: top-1 agreement (all positions, and the first generated token
alone) and the drift of the exact run's token's log-probability (mean and
largest) and the mean KL divergence. The tiny model's weights are drawn
wide, so its greedy tokens swing on small changes (the end-to-end negative
controls need that): read its figures as a stress test, the synthetic layer
as the realistic one. The same measurement through the real vLLM engine is
``tests/e2e/test_compression.py`` (it prints its figures).

Writes ``bench/results/compression.json`` (``compression-quick.json`` for
``--quick``).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from bench.common import bench_parser, format_table, result_name, write_json
from bench.tiny_models import HEAD_DIM as TINY_HEAD_DIM
from bench.tiny_models import VOCAB_SIZE, TinyLlama
from kvtriton import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.cli import progress
from kvtriton.kernels import compression_layout
from kvtriton.kernels._compression import E4M3_MAX, dequantize_groups, quantize_groups
from kvtriton.worker import HostSlab, PagedKV, TransferEngine

HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16
K_OUTLIER_CHANNELS = 6
"""Channels per K head that are 10-30x larger than the rest (fixed across tokens)."""
V_OUTLIER_CHANNELS = 2
LOGIT_STD = 2.0
"""Standard deviation of the attention logits of the random queries."""


def synthetic_kv(tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as ``(tokens, heads, head_dim)`` bf16, with outlier channels and token spread."""
    token_scale = torch.exp(torch.randn(tokens, 1, 1, generator=generator) * 0.5)
    k = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator) * token_scale
    v = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator) * token_scale.sqrt()
    for head in range(HEADS):
        k_channels = torch.randperm(HEAD_DIM, generator=generator)[:K_OUTLIER_CHANNELS]
        k[:, head, k_channels] *= 10 + 20 * torch.rand(K_OUTLIER_CHANNELS, generator=generator)
        k[:, head, k_channels] += 5 * torch.sign(torch.randn(K_OUTLIER_CHANNELS, generator=generator))
        v_channels = torch.randperm(HEAD_DIM, generator=generator)[:V_OUTLIER_CHANNELS]
        v[:, head, v_channels] *= 8
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


Scheme = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""Values -> (decoded values, the scale each element was coded with)."""


def group_fp8_any(group_size: int) -> Scheme:
    """kvtriton's format over a tensor's memory order: one scale per ``group_size`` contiguous elements.

    On the synthetic layer's ``(tokens, heads, dim)`` these are the groups of
    each block's page: a page (16 tokens x 8 heads x 128) is a whole number of
    groups for every group size measured, so no group straddles two pages.
    """

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(1, -1)
        codes, scales, bad = quantize_groups(flat, group_size)
        assert not bool(bad.any())
        decoded = dequantize_groups(codes, scales, group_size, x.dtype).reshape(x.shape)
        return decoded, scales.repeat_interleave(group_size, dim=1)[:, : flat.shape[1]].reshape(x.shape)

    return run


def per_tensor_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor (absmax / 448), torch's fp8 cast (round to nearest even)."""
    scale = x.float().abs().max() / E4M3_MAX
    codes = (x.float() / scale).to(torch.float8_e4m3fn)
    return (codes.float() * scale).to(x.dtype), torch.full(x.shape, float(scale))


def element_errors(x: torch.Tensor, decoded: torch.Tensor, scale: torch.Tensor) -> dict[str, float]:
    exact, approx = x.double(), decoded.double()
    error = (exact - approx).abs()
    rms = exact.pow(2).mean().sqrt()
    bound = 2.0**-4 * exact.abs() + scale.double() * 2.0**-9
    return {
        "relative_rms_error": float(error.pow(2).mean().sqrt() / rms),
        "max_error_over_rms": float(error.max() / rms),
        "share_over_bound": float((error > bound).double().mean()),
    }


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q K^T / sqrt(d)) V`` per head: q ``(queries, heads, d)``, k / v ``(tokens, heads, d)``."""
    scores = torch.einsum("qhd,thd->hqt", q.double(), k.double()) / math.sqrt(HEAD_DIM)
    return torch.einsum("hqt,thd->qhd", torch.softmax(scores, dim=-1), v.double())


def relative_error(exact: torch.Tensor, approx: torch.Tensor) -> float:
    return float((exact - approx).pow(2).sum().sqrt() / exact.pow(2).sum().sqrt())


def bytes_per_block() -> list[dict[str, object]]:
    """Compressed over uncompressed bytes per block, from the format and from a real CPU engine store job."""
    rows: list[dict[str, object]] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        layers = [torch.zeros(2, 4, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=dtype) for _ in range(2)]
        plain = PagedKV.from_tensors(layers)
        compressed = plain.with_compression("fp8-e4m3")
        moved = {}
        for kv in (plain, compressed):
            with HostSlab(4, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab, "torch") as engine:
                engine.submit_store(1, GPULoadStoreSpec([0, 1, 2]), CPULoadStoreSpec([0, 1, 2]))
                (result,) = engine.get_finished()
                moved[kv.compression.value] = result.transfer_size
        layout = compression_layout(plain.pages, HEAD_DIM)
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "group_size": HEAD_DIM,
                "raw_row_bytes": plain.row_bytes,
                "compressed_row_bytes": compressed.row_bytes,
                "format_ratio": layout.ratio,
                "engine_bytes_moved_ratio": moved["fp8-e4m3"] / moved["none"],
                "blocks_per_gib_gain": plain.row_bytes / compressed.row_bytes,
            }
        )
    return rows


TINY_BLOCK_TOKENS = 32
"""The end-to-end tests' block size."""
TINY_PREFIX_TOKENS = 4 * TINY_BLOCK_TOKENS
"""The cached prefix: 4 blocks (what the end-to-end test's warm request loads)."""
TINY_SUFFIX_TOKENS = 5
"""Prompt tokens after the prefix (the end-to-end prompt's partial block), computed over the loaded prefix."""
TINY_DECODE_TOKENS = 6


def in_page_order(scheme: Scheme, block_tokens: int, *, channel_major: bool) -> Scheme:
    """``scheme`` over a ``(1, heads, tokens, dim)`` cache laid out as vLLM's CPU pages: per block of ``block_tokens``,
    head by head, ``(dim, token)`` when ``channel_major`` (its K pages) else ``(token, dim)`` (its V pages)."""

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, heads, tokens, dim = x.shape
        blocks = x.reshape(heads, tokens // block_tokens, block_tokens, dim).transpose(
            0, 1
        )  # (block, head, token, dim)
        pages = (blocks.transpose(2, 3) if channel_major else blocks).contiguous()
        decoded, scale = scheme(pages)

        def back(page_values: torch.Tensor) -> torch.Tensor:
            ordered = page_values.transpose(2, 3) if channel_major else page_values
            return ordered.transpose(0, 1).reshape(x.shape)

        return back(decoded), back(scale)

    return run


def cpu_page_schemes(block_tokens: int) -> tuple[Scheme, Scheme]:
    """kvtriton's G=128 format over vLLM's CPU pages of ``block_tokens``: K's pages channel-major, V's token-major."""
    return (
        in_page_order(group_fp8_any(128), block_tokens, channel_major=True),
        in_page_order(group_fp8_any(128), block_tokens, channel_major=False),
    )


def _next_token_figures(exact: torch.Tensor, approx: torch.Tensor, chosen: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement, drift of the chosen tokens' log-probabilities and KL(exact || approx) over positions."""
    log_p, log_q = torch.log_softmax(exact.double(), dim=-1), torch.log_softmax(approx.double(), dim=-1)
    drift = (log_q.gather(-1, chosen[:, None]) - log_p.gather(-1, chosen[:, None])).abs().squeeze(-1)
    agree = (log_q.argmax(-1) == log_p.argmax(-1)).double()
    return {
        "top1_agreement": float(agree.mean()),
        "first_token_top1_agreement": float(agree[0]),
        "mean_abs_logprob_drift": float(drift.mean()),
        "max_abs_logprob_drift": float(drift.max()),
        "mean_kl_nats": float((log_p.exp() * (log_p - log_q)).sum(-1).mean()),
    }


def _cache_errors(
    prefix: str, exact: Sequence[torch.Tensor], coded: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, float]:
    """:func:`element_errors` over every layer's tensor at once, keys prefixed ``k_`` or ``v_``."""
    flat = [
        torch.cat([tensor.flatten() for tensor in tensors])
        for tensors in (exact, [d for d, _ in coded], [s for _, s in coded])
    ]
    return {f"{prefix}_{key}": value for key, value in element_errors(*flat).items()}


def cached_kv(model: Any, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K and V after ``model`` has run over ``ids``: the cache a load would hand back."""
    cache = model(ids, use_cache=True).past_key_values
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def cache_of(kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A fresh transformers cache holding copies of ``kv`` (a forward pass appends to the cache it is given)."""
    from transformers import DynamicCache

    cache: Any = DynamicCache()  # Any: transformers leaves update's arguments untyped
    for index, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), index)
    return cache


def add_share(sums: dict[str, float], figures: Mapping[str, float], count: int) -> None:
    """Add ``figures`` to ``sums`` as one of ``count`` equal shares: the mean once all ``count`` are in."""
    for key, value in figures.items():
        sums[key] = sums.get(key, 0.0) + value / count


def tiny_model_figures(
    schemes: Mapping[str, tuple[Scheme, Scheme]], prompts: int, generator: torch.Generator
) -> dict[str, dict[str, float]] | str:
    """The tiny Llama's figures per scheme (its K and its V scheme), averaged over ``prompts`` random prompts; or why not."""
    try:
        importlib.import_module("transformers")  # cache_of imports what it needs from it
    except ImportError as error:  # the GPU machine has torch and triton only
        return f"transformers is not installed ({error})"
    model: Any = TinyLlama().build().to(torch.bfloat16).eval()
    attention_outputs: list[torch.Tensor] = []

    def record(_module: object, _inputs: object, output: tuple[torch.Tensor, ...]) -> None:
        attention_outputs.append(output[0].detach().double())

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(record)

    def continue_from(cache: Any, fed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the fed tokens over ``cache`` and every layer's attention output for them, concatenated."""
        attention_outputs.clear()
        logits = model(fed, past_key_values=cache, use_cache=True).logits[0]
        return logits, torch.cat([output.flatten() for output in attention_outputs])

    sums: dict[str, dict[str, float]] = {name: {} for name in schemes}
    with torch.no_grad():
        for _ in progress(range(prompts), prompts, "tiny model", stream=sys.stderr):
            ids = torch.randint(3, VOCAB_SIZE, (1, TINY_PREFIX_TOKENS + TINY_SUFFIX_TOKENS), generator=generator)
            layers = cached_kv(model, ids[:, :TINY_PREFIX_TOKENS])

            # The exact run's greedy tokens, fed to every scheme (teacher forcing: the same context everywhere).
            fed = ids[:, TINY_PREFIX_TOKENS:]
            cache = cache_of(layers)
            step_input = fed
            for _ in range(TINY_DECODE_TOKENS - 1):
                next_token = model(step_input, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                fed, step_input = torch.cat([fed, next_token], dim=1), next_token
            exact_logits, exact_attention = continue_from(cache_of(layers), fed)
            positions = slice(TINY_SUFFIX_TOKENS - 1, None)  # the logits that predict the generated tokens
            chosen = exact_logits[positions].argmax(-1)
            exact_k, exact_v = [k for k, _ in layers], [v for _, v in layers]
            for name, (k_scheme, v_scheme) in schemes.items():
                keys, values = list(map(k_scheme, exact_k)), list(map(v_scheme, exact_v))
                figures = _cache_errors("k", exact_k, keys) | _cache_errors("v", exact_v, values)
                logits, attention = continue_from(cache_of([(k, v) for (k, _), (v, _) in zip(keys, values)]), fed)
                figures["attention_relative_error"] = relative_error(exact_attention, attention)
                figures |= _next_token_figures(exact_logits[positions], logits[positions], chosen)
                add_share(sums[name], figures, prompts)
    return sums


@dataclass(frozen=True, slots=True)
class GreedyAgreement:
    """How far a run's greedy tokens follow a reference run's, over the same prompts."""

    prompts: int
    first_token_agreement: int
    """Prompts whose first generated token is the reference's."""
    sequence_agreement: int
    """Prompts whose every generated token is the reference's."""
    mean_first_divergence: float
    """The mean position (from 0) of the first token that differs; a sequence that never differs counts its length."""
    mean_abs_logprob_drift: float
    """``|log p(t) - log p_ref(t)|`` of the token ``t`` both chose, over every position before the first divergence."""
    max_abs_logprob_drift: float

    def summary(self) -> str:
        """One line: ``first token 8/8, whole sequence 3/8, first divergence at token 17.8, |d logprob| mean ... max ...``."""
        return (
            f"first token {self.first_token_agreement}/{self.prompts}, whole sequence {self.sequence_agreement}/{self.prompts}, "
            f"first divergence at token {self.mean_first_divergence:.1f}, "
            f"|d logprob| mean {self.mean_abs_logprob_drift:.4f} max {self.max_abs_logprob_drift:.4f}"
        )

    def as_dict(self) -> dict[str, float]:
        return {name: float(getattr(self, name)) for name in self.__slots__}


def greedy_agreement(
    reference: Sequence[Sequence[int]],
    candidate: Sequence[Sequence[int]],
    reference_logprobs: Sequence[Sequence[Mapping[int, float]]],
    candidate_logprobs: Sequence[Sequence[Mapping[int, float]]],
) -> GreedyAgreement:
    """The agreement of ``candidate``'s tokens (and log-probabilities, per position: token -> log p) with ``reference``'s.

    Before the first divergence both runs saw the same context and chose the
    same token, which vLLM always returns among a position's log-probabilities,
    so the drift is defined at every such position.
    """
    if len(reference) != len(candidate) or not reference:
        raise ValueError(
            f"reference and candidate must hold the same prompts, got {len(reference)} and {len(candidate)}"
        )
    divergences: list[int] = []
    drifts: list[float] = []
    for ref_tokens, tokens, ref_logprobs, logprobs in zip(reference, candidate, reference_logprobs, candidate_logprobs):
        if len(ref_tokens) != len(tokens):
            raise ValueError(f"sequences of {len(ref_tokens)} and {len(tokens)} tokens: generate the same number")
        divergence = next((index for index, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), len(tokens))
        divergences.append(divergence)
        drifts += [
            abs(logprobs[index][token] - ref_logprobs[index][token])
            for index, token in enumerate(ref_tokens[:divergence])
        ]
    return GreedyAgreement(
        prompts=len(reference),
        first_token_agreement=sum(divergence > 0 for divergence in divergences),
        sequence_agreement=sum(divergence == len(tokens) for divergence, tokens in zip(divergences, candidate)),
        mean_first_divergence=sum(divergences) / len(divergences),
        mean_abs_logprob_drift=sum(drifts) / len(drifts) if drifts else math.nan,
        max_abs_logprob_drift=max(drifts, default=math.nan),
    )


REAL_BLOCK_TOKENS = 32
"""The block size of the real-model runs (vLLM's CPU attention takes multiples of 32)."""
REAL_PREFIX_BLOCKS = 5
"""Blocks of the reference text cached (and decoded through each scheme) before the teacher-forced part."""
REAL_TOP_LOGPROBS = 5


def scale_one_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``kv_cache_dtype="fp8"`` without calibrated scales: every element cast to e4m3 with a scale of 1.0."""
    return x.to(torch.float8_e4m3fn).to(x.dtype), torch.ones_like(x)


def teacher_forced_figures(
    model: Any, text: Sequence[int], schemes: Mapping[str, tuple[Scheme, Scheme]]
) -> dict[str, dict[str, float]]:
    """Per scheme, over ``text`` (token ids): its first :data:`REAL_PREFIX_BLOCKS` blocks cached and decoded through
    the scheme, the rest fed as it is (every position's context is the text's, whatever the model would say), and the
    next-token figures of :func:`_next_token_figures` for the text's own tokens against the exact cache."""
    prefix = REAL_PREFIX_BLOCKS * REAL_BLOCK_TOKENS
    if len(text) < prefix + 2:
        raise ValueError(f"text has {len(text)} tokens, the teacher-forced measurement needs more than {prefix + 1}")
    ids = torch.tensor([list(text)])
    with torch.no_grad():
        layers = cached_kv(model, ids[:, :prefix])

        def logits_over(kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
            return model(ids[:, prefix:-1], past_key_values=cache_of(kv), use_cache=True).logits[0]

        exact = logits_over(layers)
        following = ids[0, prefix + 1 :]
        figures: dict[str, dict[str, float]] = {}
        for name, (k_scheme, v_scheme) in schemes.items():
            decoded = [(k_scheme(k)[0], v_scheme(v)[0]) for k, v in layers]
            figures[name] = _next_token_figures(exact, logits_over(decoded), following)
            figures[name]["positions"] = float(len(following))
    return figures


def real_model_figures(prompts: int, tokens: int) -> dict[str, object] | str:
    """SmolLM2-135M-Instruct's figures (:mod:`bench.real_model`): real engines and teacher-forced text; or why not."""
    from bench.real_model import MODEL_NAME, ModelUnavailable, prepared_model

    try:
        model = prepared_model()
    except ModelUnavailable as error:
        return f"{MODEL_NAME} is unavailable: {error}"
    # The end-to-end tests' engine launcher (tests/e2e/engine.py, imported as ``e2e``) runs the engines here too.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tests.e2e.real_text import offload_steps, real_text_job, run_engines, single_tier_config
    from tests.e2e.vllm_cpu import fp8_kv_cache_problem

    chats = model.chat_prompts[:prompts]
    steps = offload_steps(chats, tokens, logprobs=REAL_TOP_LOGPROBS)
    cold_and_local = steps[:2]
    jobs = {
        "none": real_text_job(model.path, cold_and_local, None),
        "kvtriton": real_text_job(model.path, steps, single_tier_config()),
        "kvtriton fp8-e4m3": real_text_job(
            model.path, [s for s in steps if s.get("name") != "local"], single_tier_config(kv_compression="fp8-e4m3")
        ),
    }
    vllm_fp8_problem = fp8_kv_cache_problem()
    if vllm_fp8_problem is None:
        jobs["vLLM fp8 KV cache"] = real_text_job(model.path, cold_and_local, None, kv_cache_dtype="fp8")
    else:
        print(f"real model: no vLLM fp8 KV cache run: {vllm_fp8_problem}", file=sys.stderr)
    print(
        f"real model: {len(jobs)} vLLM engines at once, {len(chats)} chat prompts, {tokens} greedy tokens each",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="compression-real-") as scratch:
        runs = run_engines({name: (job, Path(scratch) / name.replace(" ", "-")) for name, job in jobs.items()})

    def completions(engine: str, step: str) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
        chosen = runs[engine].step(step).completions
        return [c.token_ids for c in chosen], [c.logprobs for c in chosen]

    reference_tokens, reference_logprobs = completions("none", "local")
    engine: dict[str, dict[str, float]] = {}
    for name, step in (("kvtriton", "warm"), ("kvtriton fp8-e4m3", "warm"), ("vLLM fp8 KV cache", "local")):
        if name not in runs:
            continue
        candidate_tokens, candidate_logprobs = completions(name, step)
        engine[name] = greedy_agreement(
            reference_tokens, candidate_tokens, reference_logprobs, candidate_logprobs
        ).as_dict()
    engine["kvtriton"]["cold_equals_no_connector"] = float(
        completions("kvtriton", "cold")[0] == completions("none", "cold")[0]
    )
    stored = runs["kvtriton fp8-e4m3"].delta("cold", "vllm:kv_offload_store_bytes")
    raw = runs["kvtriton"].delta("cold", "vllm:kv_offload_store_bytes")

    from transformers import AutoModelForCausalLM

    hf_model: Any = (
        cast(Any, AutoModelForCausalLM).from_pretrained(model.path, dtype=torch.float32).eval()
    )  # untyped factory
    teacher_forced = teacher_forced_figures(
        hf_model,
        model.reference_text,
        {
            "kvtriton fp8-e4m3": cpu_page_schemes(REAL_BLOCK_TOKENS),
            "vLLM fp8 KV cache (emulated: e4m3, scale 1.0)": (scale_one_fp8, scale_one_fp8),
        },
    )
    lengths = [len(chat) for chat in chats]
    return {
        "model": MODEL_NAME,
        "dtype": "float32",
        "block_size": REAL_BLOCK_TOKENS,
        "prompts": len(chats),
        "prompt_tokens": [min(lengths), max(lengths)],
        "shared_prompt_tokens": model.system_prompt_tokens,
        "generated_tokens": tokens,
        "engine": engine,
        "fp8_stored_bytes_ratio": stored / raw,
        "teacher_forced": teacher_forced,
        "teacher_forced_prefix_tokens": REAL_PREFIX_BLOCKS * REAL_BLOCK_TOKENS,
        "teacher_forced_text_tokens": len(model.reference_text),
    }


def print_real_model(real: Mapping[str, Any]) -> None:
    """The real model's two tables: greedy agreement through real engines, and teacher-forced drift."""
    print(
        f"\n{real['model']} ({real['dtype']}), {real['prompts']} chat prompts of {real['prompt_tokens'][0]}-"
        f"{real['prompt_tokens'][1]} tokens ({real['shared_prompt_tokens']} shared), {real['generated_tokens']} greedy "
        "tokens, the prefix loaded after a prefix-cache reset, against the same prefix from vLLM's own cache:"
    )
    print(
        format_table(
            [
                "run",
                "first token agrees",
                "whole sequence agrees",
                "mean first divergence",
                "mean |d logprob|",
                "max |d logprob|",
            ],
            [
                [
                    name,
                    f"{f['first_token_agreement']:.0f}/{f['prompts']:.0f}",
                    f"{f['sequence_agreement']:.0f}/{f['prompts']:.0f}",
                    f"{f['mean_first_divergence']:.1f}",
                    f"{f['mean_abs_logprob_drift']:.4f}",
                    f"{f['max_abs_logprob_drift']:.4f}",
                ]
                for name, f in real["engine"].items()
            ],
        )
    )
    print(
        f"\nteacher-forced over a {real['teacher_forced_text_tokens']}-token text, the first "
        f"{real['teacher_forced_prefix_tokens']} tokens cached through each scheme:"
    )
    print(
        format_table(
            ["scheme", "top-1 agreement", "mean |d logprob|", "max |d logprob|", "mean KL (nats)"],
            [
                [
                    name,
                    f"{f['top1_agreement']:.3f}",
                    f"{f['mean_abs_logprob_drift']:.4f}",
                    f"{f['max_abs_logprob_drift']:.4f}",
                    f"{f['mean_kl_nats']:.5f}",
                ]
                for name, f in real["teacher_forced"].items()
            ],
        )
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = bench_parser("compression", __doc__, quick="512 tokens, 1 seed, 4 prompts, no real model")
    parser.add_argument("--tokens", type=int, default=4096, help="cached tokens of the synthetic layer (default: 4096)")
    parser.add_argument(
        "--queries", type=int, default=32, help="random queries per head for the attention error (default: 32)"
    )
    parser.add_argument(
        "--seeds", type=int, default=3, help="independent synthetic layers, figures averaged (default: 3)"
    )
    parser.add_argument(
        "--prompts", type=int, default=32, help="random prompts through the tiny model (default: 32; 0 skips it)"
    )
    parser.add_argument(
        "--real-prompts",
        type=int,
        default=8,
        help="SmolLM2-135M chat prompts through real vLLM engines (default: 8, at most 8; 0 skips the real model)",
    )
    parser.add_argument("--real-tokens", type=int, default=32, help="greedy tokens per real-model prompt (default: 32)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for flag, value in (("--tokens", args.tokens), ("--queries", args.queries), ("--seeds", args.seeds)):
        if value < 1:
            raise SystemExit(f"{flag} must be >= 1, got {value}")
    if args.prompts < 0:
        raise SystemExit(f"--prompts must be >= 0 (0 skips the tiny model), got {args.prompts}")
    if not 0 <= args.real_prompts <= 8:
        raise SystemExit(
            f"--real-prompts must be 0 to 8 (the model's chat prompts; 0 skips it), got {args.real_prompts}"
        )
    if args.real_tokens < 1:
        raise SystemExit(f"--real-tokens must be >= 1, got {args.real_tokens}")
    real_prompts = 0 if args.quick else args.real_prompts
    tokens, seeds, prompts = (512, 1, min(args.prompts, 4)) if args.quick else (args.tokens, args.seeds, args.prompts)
    if args.quick:
        print("SMOKE RUN (--quick): 512 tokens, one seed, at most 4 prompts; the figures are no verdict.")
    tokens = -(-tokens // BLOCK_SIZE) * BLOCK_SIZE
    schemes: dict[str, Scheme] = {
        f"group fp8 (G={HEAD_DIM})": group_fp8_any(HEAD_DIM),
        "group fp8 (G=32)": group_fp8_any(32),
        "per-tensor fp8": per_tensor_fp8,
    }
    sums: dict[str, dict[str, float]] = {name: {} for name in schemes}
    for seed in progress(range(seeds), seeds, "compression bench", stream=sys.stderr):
        generator = torch.Generator().manual_seed(seed)
        k, v = synthetic_kv(tokens, generator)
        q = torch.randn(args.queries, HEADS, HEAD_DIM, generator=generator)
        # Queries scaled so that the logits q.k / sqrt(d) have a standard deviation of LOGIT_STD (a softmax
        # over thousands of tokens that neither ignores the keys nor attends to one token only).
        logits = torch.einsum("qhd,thd->hqt", q.double(), k.double()) / math.sqrt(HEAD_DIM)
        q = (q * (LOGIT_STD / float(logits.std()))).to(torch.bfloat16)
        reference = attention(q, k, v)
        for name, scheme in schemes.items():
            k2, k_scale = scheme(k)
            v2, v_scale = scheme(v)
            figures = _cache_errors("k", [k], [(k2, k_scale)]) | _cache_errors("v", [v], [(v2, v_scale)])
            figures["attention_relative_error"] = relative_error(reference, attention(q, k2, v2))
            figures["attention_relative_error_k_only"] = relative_error(reference, attention(q, k2, v))
            add_share(sums[name], figures, seeds)
    headers = [
        "scheme",
        "K rel. RMS err",
        "K max err / RMS",
        "K over bound",
        "V rel. RMS err",
        "V over bound",
        "attention rel. err",
    ]
    table = [
        [
            name,
            f"{f['k_relative_rms_error']:.4f}",
            f"{f['k_max_error_over_rms']:.3f}",
            f"{f['k_share_over_bound']:.4f}",
            f"{f['v_relative_rms_error']:.4f}",
            f"{f['v_share_over_bound']:.4f}",
            f"{f['attention_relative_error']:.4f}",
        ]
        for name, f in sums.items()
    ]
    print(f"synthetic Llama-3-8B-shaped layer: {tokens} tokens, {HEADS} KV heads x {HEAD_DIM}, bf16, {seeds} seed(s)")
    print(format_table(headers, table))
    sizes = bytes_per_block()
    print("\nbytes per block (2 layers x K,V pages of 16 tokens x 8 heads x 128; G = 128):")
    print(
        format_table(
            ["dtype", "raw B", "compressed B", "format ratio", "engine bytes moved ratio", "blocks per GiB gain"],
            [
                [
                    row["dtype"],
                    row["raw_row_bytes"],
                    row["compressed_row_bytes"],
                    f"{row['format_ratio']:.4f}",
                    f"{row['engine_bytes_moved_ratio']:.4f}",
                    f"{row['blocks_per_gib_gain']:.3f}x",
                ]
                for row in sizes
            ],
        )
    )
    tiny: dict[str, dict[str, float]] | str = "skipped (--prompts 0)"
    if prompts:
        tiny = tiny_model_figures(
            {
                f"group fp8 (G={TINY_HEAD_DIM}, head vectors)": (
                    group_fp8_any(TINY_HEAD_DIM),
                    group_fp8_any(TINY_HEAD_DIM),
                ),
                "group fp8 (G=128, vLLM CPU pages)": cpu_page_schemes(TINY_BLOCK_TOKENS),
                "per-tensor fp8": (per_tensor_fp8, per_tensor_fp8),
            },
            prompts,
            torch.Generator().manual_seed(0),
        )
    if isinstance(tiny, str):
        print(f"\ntiny model: {tiny}")
    else:
        print(
            f"\nthe end-to-end tests' tiny Llama, bf16, {prompts} random prompts; a cached prefix of "
            f"{TINY_PREFIX_TOKENS} tokens, {TINY_SUFFIX_TOKENS} more prompt tokens, {TINY_DECODE_TOKENS} teacher-forced greedy tokens:"
        )
        print(
            format_table(
                [
                    "scheme",
                    "K rel. RMS err",
                    "V rel. RMS err",
                    "attention rel. err",
                    "top-1 agree",
                    "first token agree",
                    "mean |d logprob|",
                    "max |d logprob|",
                    "mean KL (nats)",
                ],
                [
                    [
                        name,
                        f"{f['k_relative_rms_error']:.4f}",
                        f"{f['v_relative_rms_error']:.4f}",
                        f"{f['attention_relative_error']:.4f}",
                        f"{f['top1_agreement']:.3f}",
                        f"{f['first_token_top1_agreement']:.3f}",
                        f"{f['mean_abs_logprob_drift']:.4f}",
                        f"{f['max_abs_logprob_drift']:.4f}",
                        f"{f['mean_kl_nats']:.5f}",
                    ]
                    for name, f in tiny.items()
                ],
            )
        )
    real: dict[str, object] | str = "skipped (--real-prompts 0 or --quick)"
    if real_prompts:
        real = real_model_figures(real_prompts, args.real_tokens)
    if isinstance(real, str):
        print(f"\nreal model: {real}")
    else:
        print_real_model(real)
    payload: dict[str, object] = {
        "smoke_run": args.quick,
        "tokens": tokens,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "queries": args.queries,
        "seeds": seeds,
        "k_outlier_channels_per_head": K_OUTLIER_CHANNELS,
        "v_outlier_channels_per_head": V_OUTLIER_CHANNELS,
        "accuracy": sums,
        "bytes": sizes,
        "tiny_model": tiny,
        "tiny_model_prompts": prompts,
        "real_model": real,
        "note": "errors are averaged over seeds; attention error is ||o' - o|| / ||o|| over every query and head, in float64",
    }
    print(f"wrote {write_json(result_name(args), payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
