"""A real vLLM engine on CPU generates what ``transformers`` generates from the same weights, request by request.

No KV connector: these tests check the engine itself on the installed vLLM (0.33, or 0.34 with the
stand-in ops of :mod:`e2e.vllm_cpu_ops`): its model runner's input preparation, block tables and
slot mappings, attention, sampling and per-request state, batched. The reference is ``transformers``
on the same checkpoint in float32, one request at a time, with the same logit processing written out
by hand; greedy tokens must be equal to the last one, prompt log-probabilities equal to float32
rounding. Engines: the tiny Llama (random weights) with requests that exercise each sampling option,
and SmolLM2-135M-Instruct (:mod:`bench.real_model`) on its chat prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from bench.real_model import PreparedModel
from e2e.prompts import PROMPT_A
from e2e.sampling_job import SampledRequest, SamplingJob, SamplingResult, run_sampling_engine

MAX_TOKENS = 16
PROMPT_B = list(range(300, 340))
"""40 tokens: one full block of 32 and a partial one."""
ONE_TOKEN_PROMPT = [7]
SEEDED_PROMPT = [5, 6, 7, 8]
ALLOWED = [11, 42, 97, 500, 1000]
BIAS = {42: 0.75, 500: -0.5, 97: 0.25}
SMOLLM2_PROMPTS = 3

LogitRule = Callable[[torch.Tensor, int], torch.Tensor]
"""Changes one position's logits (float32, the vocabulary) before the argmax; the int is the number of tokens generated so far."""


def _load(path: Path) -> Any:
    """The checkpoint under ``path`` as a float32 ``transformers`` model in eval mode (Any: transformers is untyped)."""
    from transformers import AutoModelForCausalLM

    return cast(Any, AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32).eval()


def _reference_greedy(model: Any, prompt: list[int], rules: list[LogitRule] | None = None) -> list[int]:
    """:data:`MAX_TOKENS` greedy tokens after ``prompt``, each position's logits passed through ``rules`` first.

    The prompt in one forward pass, then one token at a time on ``transformers``' KV cache, as an engine decodes.
    """
    generated: list[int] = []
    with torch.no_grad():
        output = model(torch.tensor([prompt]), use_cache=True)
        while True:
            logits = cast(torch.Tensor, output.logits)[0, -1].float()
            for rule in rules or []:
                logits = rule(logits, len(generated))
            generated.append(int(logits.argmax()))
            if len(generated) == MAX_TOKENS:
                return generated
            output = model(torch.tensor([generated[-1:]]), past_key_values=output.past_key_values, use_cache=True)


def _only(allowed: list[int]) -> LogitRule:
    def rule(logits: torch.Tensor, generated: int) -> torch.Tensor:
        del generated
        kept = torch.full_like(logits, float("-inf"))
        kept[allowed] = logits[allowed]
        return kept

    return rule


def _biased(bias: dict[int, float]) -> LogitRule:
    def rule(logits: torch.Tensor, generated: int) -> torch.Tensor:
        del generated
        biased = logits.clone()
        for token, value in bias.items():
            biased[token] += value
        return biased

    return rule


def _banned_before(min_tokens: int, stop_token_ids: list[int]) -> LogitRule:
    def rule(logits: torch.Tensor, generated: int) -> torch.Tensor:
        if generated >= min_tokens:
            return logits
        banned = logits.clone()
        banned[stop_token_ids] = float("-inf")
        return banned

    return rule


@pytest.fixture(scope="module")
def tiny_reference(llama: Path) -> Any:
    return _load(llama)


@pytest.fixture(scope="module")
def plain_greedy(tiny_reference: Any) -> list[int]:
    """PROMPT_A's greedy tokens without any logit rule (the stop tokens of the min_tokens request come from it)."""
    return _reference_greedy(tiny_reference, PROMPT_A)


@pytest.fixture(scope="module")
def tiny_requests(plain_greedy: list[int]) -> list[SampledRequest]:
    return [
        SampledRequest(PROMPT_A, {"max_tokens": MAX_TOKENS}),
        SampledRequest(ONE_TOKEN_PROMPT, {"max_tokens": MAX_TOKENS}),
        SampledRequest(PROMPT_B, {"max_tokens": MAX_TOKENS, "prompt_logprobs": 1}),
        SampledRequest(PROMPT_B, {"max_tokens": MAX_TOKENS, "allowed_token_ids": ALLOWED, "logit_bias": BIAS}),
        SampledRequest(
            PROMPT_A, {"max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "stop_token_ids": plain_greedy[:4]}
        ),
        SampledRequest(SEEDED_PROMPT, {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11}),
        SampledRequest(SEEDED_PROMPT, {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11}),
        SampledRequest(SEEDED_PROMPT, {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 12}),
    ]


@pytest.fixture(scope="module")
def tiny_run(
    llama: Path, tiny_requests: list[SampledRequest], tmp_path_factory: pytest.TempPathFactory
) -> SamplingResult:
    return run_sampling_engine(SamplingJob(model=str(llama), requests=tiny_requests), tmp_path_factory.mktemp("tiny"))


def test_greedy_tokens_of_a_batch_equal_transformers_one_request_at_a_time(
    tiny_run: SamplingResult, tiny_reference: Any, plain_greedy: list[int]
) -> None:
    """Several requests in one batch, of 133, 1 and 40 prompt tokens (full blocks, a partial one, a single token)."""
    assert tiny_run.outputs[0].token_ids == plain_greedy
    assert tiny_run.outputs[1].token_ids == _reference_greedy(tiny_reference, ONE_TOKEN_PROMPT)
    assert tiny_run.outputs[2].token_ids == _reference_greedy(tiny_reference, PROMPT_B)


def test_prompt_logprobs_are_those_of_each_next_prompt_token(tiny_run: SamplingResult, tiny_reference: Any) -> None:
    with torch.no_grad():
        logits = cast(torch.Tensor, tiny_reference(torch.tensor([PROMPT_B])).logits)[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    positions = tiny_run.outputs[2].prompt_logprobs
    assert len(positions) == len(PROMPT_B) - 1
    for index, position in enumerate(positions):
        token = PROMPT_B[index + 1]
        assert token in position, f"prompt position {index + 1} lacks its own token {token}: {position}"
        assert position[token] == pytest.approx(float(expected[index, token]), abs=1e-3)


def test_allowed_tokens_and_logit_bias_pick_the_tokens_transformers_picks_under_them(
    tiny_run: SamplingResult, tiny_reference: Any
) -> None:
    tokens = tiny_run.outputs[3].token_ids
    assert set(tokens) <= set(ALLOWED)
    assert tokens == _reference_greedy(tiny_reference, PROMPT_B, [_only(ALLOWED), _biased(BIAS)])


def test_min_tokens_keeps_the_stop_tokens_out(
    tiny_run: SamplingResult, tiny_reference: Any, plain_greedy: list[int]
) -> None:
    stops = plain_greedy[:4]
    tokens = tiny_run.outputs[4].token_ids
    assert not set(tokens) & set(stops)
    assert tokens == _reference_greedy(tiny_reference, PROMPT_A, [_banned_before(MAX_TOKENS, stops)])


def test_a_seeded_request_samples_by_its_seed(tiny_run: SamplingResult) -> None:
    same, again, other = (tiny_run.outputs[index].token_ids for index in (5, 6, 7))
    assert len(same) == MAX_TOKENS
    assert same == again, "two requests with one seed sampled differently"
    assert same != other, "two seeds sampled the same 16 tokens"


def test_smollm2_greedy_tokens_equal_transformers(
    smollm2: PreparedModel, tmp_path_factory: pytest.TempPathFactory
) -> None:
    prompts = smollm2.chat_prompts[:SMOLLM2_PROMPTS]
    run = run_sampling_engine(
        SamplingJob(model=str(smollm2.path), requests=[SampledRequest(p, {"max_tokens": MAX_TOKENS}) for p in prompts]),
        tmp_path_factory.mktemp("smollm2"),
    )
    reference = _load(smollm2.path)
    assert [output.token_ids for output in run.outputs] == [_reference_greedy(reference, prompt) for prompt in prompts]
