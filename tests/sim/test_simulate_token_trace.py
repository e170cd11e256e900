"""The token workload a producer sends to a real engine, and the trace it writes for ``kvtriton simulate``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtriton.sim._token_trace import TokenWorkloadParams, block_hashes, token_workload, trace_lines, write_trace
from kvtriton.sim._workloads import read_trace


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others() -> None:
    assert token_workload(seed=5) == token_workload(seed=5)
    assert token_workload(seed=5) != token_workload(seed=6)


def test_the_default_workload_is_a_few_hundred_short_requests() -> None:
    requests = token_workload()
    shape = TokenWorkloadParams()
    assert len(requests) == 300
    assert len({request.req_id for request in requests}) == 300
    lengths = [len(request.prompt) for request in requests]
    assert min(lengths) >= shape.system_tokens[0] + shape.user_tokens[0]
    assert max(lengths) < 1024  # fits a small model's context
    tokens = {token for request in requests for token in request.prompt}
    assert min(tokens) >= shape.first_token and max(tokens) < shape.vocab_size


def test_conversation_turns_resend_the_previous_turn_and_its_answer() -> None:
    requests = token_workload(seed=2, params=TokenWorkloadParams(requests=200, conversation_share=1.0))
    extends = 0
    for index, later in enumerate(requests):
        for earlier in requests[:index]:
            if len(later.prompt) > len(earlier.prompt) and later.prompt[: len(earlier.prompt)] == earlier.prompt:
                extends += 1
                break
    assert extends > 100  # most turns continue an earlier prompt


def test_chained_hashes_agree_exactly_on_shared_prefixes() -> None:
    base = list(range(10, 74))  # 4 blocks of 16
    same_start = base[:40] + [999] * 24
    assert block_hashes(base, 16)[:2] == block_hashes(same_start, 16)[:2]
    assert block_hashes(base, 16)[2] != block_hashes(same_start, 16)[2]
    assert block_hashes(base[:47], 16) == block_hashes(base, 16)[:2]  # only full blocks are hashed
    # The chain: an equal block after a different prefix has a different hash.
    assert block_hashes([1] * 16 + [7] * 16, 16)[1] != block_hashes([2] * 16 + [7] * 16, 16)[1]
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        block_hashes(base, 0)


def test_the_written_trace_reads_back_as_the_same_requests(tmp_path: Path) -> None:
    requests = token_workload(seed=4, params=TokenWorkloadParams(requests=50))
    path = write_trace(tmp_path / "trace.jsonl", requests, block_size=32)
    read = read_trace(path, block_size=32)
    assert [request.req_id for request in read] == [request.req_id for request in requests]
    assert [request.prompt_tokens for request in read] == [len(request.prompt) for request in requests]
    assert [len(request.prompt_blocks) for request in read] == [len(request.prompt) // 32 for request in requests]
    assert list(trace_lines(requests[:1], 32))[0].startswith('{"id":"req-0000","blocks":[')


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("requests", 0, "requests must be >= 1, got 0"),
        ("user_tokens", (5, 2), r"user_tokens must be a range 1 <= low <= high, got \(5, 2\)"),
        ("conversation_share", 1.5, "conversation_share must be in 0..1, got 1.5"),
        ("first_token", 2000, "first_token must be in 0..vocab_size-1, got 2000"),
    ],
)
def test_bad_workload_parameters_are_refused_by_name(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenWorkloadParams(**{field: value})  # pyright: ignore[reportArgumentType] -- each case sets one field of its own type
