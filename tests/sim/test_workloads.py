from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from kvtriton.sim._workloads import WORKLOADS, Request, TraceBlockSizeMismatch, generate, parse_trace, read_trace

SMALL = {"requests": "60"}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_is_deterministic_per_seed(name: str) -> None:
    first = generate(name, seed=7, overrides=SMALL)
    again = generate(name, seed=7, overrides=SMALL)
    other = generate(name, seed=8, overrides=SMALL)
    assert first == again
    assert first != other
    assert len(first) == 60


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_prompt_tokens_match_the_full_prompt_blocks(name: str, block_size: int) -> None:
    for request in generate(name, seed=1, block_size=block_size, overrides=SMALL):
        full = len(request.prompt_blocks) * block_size
        assert full <= request.prompt_tokens < full + block_size


def test_shared_prompt_requests_share_exactly_the_system_prompt_blocks() -> None:
    requests = generate(
        "shared-prompt", seed=3, block_size=16,
        overrides={"requests": "40", "system_prompts": "1", "system_tokens": "64", "user_tokens_min": "20"},
    )  # fmt: skip
    first_blocks = {request.prompt_blocks[:4] for request in requests}
    assert len(first_blocks) == 1  # 64 system tokens = 4 shared blocks
    fifth_blocks = [request.prompt_blocks[4] for request in requests]
    assert len(set(fifth_blocks)) == len(fifth_blocks)  # block 5 holds user tokens: never shared


def test_chat_turn_resends_the_previous_turn_and_its_answer() -> None:
    requests = generate("chat", seed=5, block_size=8, overrides={"requests": "200", "active_conversations": "4"})
    by_conversation: dict[str, list[Request]] = collections.defaultdict(list)
    for request in requests:
        by_conversation[request.req_id.rsplit("-turn-", 1)[0]].append(request)
    follow_ups = 0
    for turns in by_conversation.values():
        for previous, current in zip(turns, turns[1:]):
            history = previous.prompt_blocks + previous.output_blocks
            assert current.prompt_blocks[: len(history)] == history
            assert len(current.prompt_blocks) >= len(history)
            follow_ups += 1
    assert follow_ups > 100


def test_conversations_share_only_the_system_prompt() -> None:
    requests = generate(
        "chat", seed=2, block_size=16, overrides={"requests": "100", "system_tokens": "32", "user_tokens_min": "17"}
    )
    firsts = {request.prompt_blocks[:2] for request in requests}
    thirds = {request.prompt_blocks[2] for request in requests if request.req_id.endswith("-turn-0")}
    assert len(firsts) == 1
    assert len(thirds) == sum(request.req_id.endswith("-turn-0") for request in requests)


def test_few_shot_popularity_follows_zipf_rank() -> None:
    requests = generate("few-shot", seed=11, overrides={"requests": "3000", "prefixes": "50", "zipf_s": "1.2"})
    counts = collections.Counter(request.prompt_blocks[0] for request in requests)
    ranked = [count for _, count in counts.most_common()]
    # rank 1 vs rank 10 of a Zipf(1.2) law: about 10 ** 1.2 = 16 times more requests
    assert ranked[0] > 8 * ranked[9]
    assert len(counts) <= 50


PREFIX_SHARING = {"requests": 50, "blocks_per_request": 8, "prefixes": 5, "prefix_blocks": 6, "zipf_s": 1.0}


def test_prefix_sharing_is_deterministic_for_a_seed_and_changes_with_it() -> None:
    assert generate("prefix-sharing", seed=3, overrides=PREFIX_SHARING) == generate(
        "prefix-sharing", seed=3, overrides=PREFIX_SHARING
    )
    assert generate("prefix-sharing", seed=4, overrides=PREFIX_SHARING) != generate(
        "prefix-sharing", seed=3, overrides=PREFIX_SHARING
    )


def test_prefix_sharing_requests_are_a_shared_prefix_then_unique_blocks() -> None:
    requests = [r.prompt_blocks for r in generate("prefix-sharing", seed=3, overrides=PREFIX_SHARING)]
    assert len(requests) == 50
    assert all(len(blocks) == 8 and len(set(blocks)) == 8 for blocks in requests)
    first_blocks = {blocks[0] for blocks in requests}
    assert 1 < len(first_blocks) <= 5  # every request starts with one of the 5 prefixes
    owners: dict[bytes, int] = {}
    for i, blocks in enumerate(requests):
        for block in blocks[3:]:  # past the shortest shared part (ceil(6 / 2) = 3)
            owners.setdefault(block, i)
        for block in blocks[6:]:  # past the longest shared part: unique to this request
            assert owners[block] == i


def test_prefix_sharing_shares_every_length_from_half_to_all_of_the_prefix() -> None:
    overrides = {**PREFIX_SHARING, "requests": 400, "prefixes": 1}
    requests = [r.prompt_blocks for r in generate("prefix-sharing", seed=0, overrides=overrides)]
    counts = collections.Counter(block for blocks in requests for block in blocks)
    shared_lengths = {sum(counts[block] > 1 for block in blocks) for blocks in requests}
    assert shared_lengths == {3, 4, 5, 6}
    assert all(r.output_blocks == () for r in generate("prefix-sharing", seed=0, overrides=overrides))


def test_prefix_sharing_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="prefix_blocks must be in 0..8, got 9"):
        generate("prefix-sharing", overrides={"requests": 1, "blocks_per_request": 8, "prefix_blocks": 9})
    with pytest.raises(ValueError, match="zipf_s must be >= 0, got -1.0"):
        generate("prefix-sharing", overrides={"zipf_s": "-1"})


def test_requests_override_and_block_size_change_the_trace_shape() -> None:
    coarse = generate("few-shot", seed=0, block_size=64, overrides={"requests": "10"})
    fine = generate("few-shot", seed=0, block_size=16, overrides={"requests": "10"})
    assert len(coarse) == len(fine) == 10
    assert sum(len(r.prompt_blocks) for r in fine) > 3 * sum(len(r.prompt_blocks) for r in coarse)


def test_unknown_workload_lists_the_valid_names() -> None:
    with pytest.raises(
        ValueError,
        match="workload must be one of shared-prompt, chat, few-shot, prefix-sharing, system-prompts, multi-turn, prefix-tree, scan, got 'web'",
    ):
        generate("web")


def test_unknown_parameter_names_the_workload_and_its_parameters() -> None:
    with pytest.raises(ValueError, match="workload 'chat' has no parameter 'turns'; its parameters are requests,"):
        generate("chat", overrides={"turns": "3"})


def test_parameter_of_the_wrong_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="parameter requests of workload 'chat' must be an integer, got '1.5'"):
        generate("chat", overrides={"requests": "1.5"})
    with pytest.raises(ValueError, match="zipf_s of workload 'few-shot' must be a number, got 'steep'"):
        generate("few-shot", overrides={"zipf_s": "steep"})


def test_inconsistent_parameters_are_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="turns_min must be <= turns_max, got 5 > 2"):
        generate("chat", overrides={"turns_min": "5", "turns_max": "2"})
    with pytest.raises(ValueError, match="requests must be positive, got 0"):
        generate("shared-prompt", overrides={"requests": "0"})


@pytest.mark.parametrize("workload", ["few-shot", "prefix-sharing"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_zipf_exponent_is_rejected_by_name(workload: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"zipf_s must be a finite number.*got {value}"):
        generate(workload, overrides={"requests": "5", "zipf_s": value})


# --------------------------------------------------------------------------
# JSON-lines traces


def test_trace_lines_become_requests_with_defaults() -> None:
    lines = [
        json.dumps({"id": "a", "blocks": ["h1", "h2"], "tokens": 40, "output_blocks": ["h3"]}),
        "",
        json.dumps({"blocks": [1, 2]}),
    ]
    first, second = parse_trace(lines, block_size=16)
    assert first == Request("a", (b"h1", b"h2"), 40, (b"h3",))
    assert second.req_id == "trace line 3"
    assert second.prompt_tokens == 32
    assert len(set(second.prompt_blocks)) == 2
    assert second.output_blocks == ()


def test_integer_and_string_hashes_never_name_the_same_block() -> None:
    # 0x6162636465666768 is "abcdefgh" in ASCII: the two must still be different blocks.
    text, number = parse_trace(['{"blocks": ["abcdefgh"]}', '{"blocks": [7017280452245743464]}'])
    assert text.prompt_blocks != number.prompt_blocks
    (same,) = parse_trace(['{"blocks": [7017280452245743464]}'])
    assert same.prompt_blocks == number.prompt_blocks


def test_comment_lines_are_skipped_and_keep_the_line_numbers() -> None:
    lines = ["# exported from gateway logs", '{"blocks": ["a"]}', "  # a note", '{"blocks": ["a", 2.5]}']
    with pytest.raises(ValueError, match=r"^trace line 4: blocks\[1\]"):
        list(parse_trace(lines))
    assert [r.prompt_blocks for r in parse_trace(lines[:3])] == [(b"a",)]


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"id": "x"}', "missing field 'blocks'"),
        ('{"blocks": "h1"}', "blocks must be a list of block hashes, got str"),
        ('{"blocks": ["h1", 2.5]}', r"blocks\[1\] must be a non-empty string or a non-negative integer, got 2.5"),
        ('{"blocks": [-1]}', r"blocks\[0\] must be a non-empty string or a non-negative integer, got -1"),
        ('{"blocks": ["a"], "output_blocks": [""]}', r"output_blocks\[0\] must be a non-empty string"),
        ('{"blocks": ["a"], "tokens": 40}', "tokens = 40 does not fit 1 full blocks of 16 tokens"),
        ('{"blocks": ["a"], "tokens": "16"}', "tokens must be an integer, got '16'"),
        ('{"blocks": ["a"], "prompt": "hi"}', "unknown field.*prompt"),
        ('{"blocks": ["a"], "id": [1]}', "id must be a string or an integer"),
        ('{"blocks": [' + "9" * 5000 + "]}", "not valid JSON.*digits"),
        ("[" * 100_000, "not valid JSON.*nested too deeply"),
        ('{"blocks": []}', "blocks is empty and tokens is 0: a request has at least one prompt token"),
        ('{"blocks": [], "tokens": 0}', "blocks is empty and tokens is 0"),
        ('{"blocks": ["a", "b", "a"]}', r"blocks\[2\] repeats blocks\[0\] \('a'\): a request's block hashes are"),
        ('{"blocks": [7, 7]}', r"blocks\[1\] repeats blocks\[0\] \(7\)"),
        ('{"blocks": ["a"], "output_blocks": ["b", "a"]}', r"output_blocks\[1\] repeats blocks\[0\]"),
        ('{"blocks": ["a"], "timestamp": [1]}', r"timestamp must be a number or a string, got \[1\]"),
        ('{"blocks": ["a"], "timestamp": true}', "timestamp must be a number or a string, got True"),
    ],
)
def test_malformed_trace_line_names_the_line_and_why(line: str, why: str) -> None:
    good = json.dumps({"blocks": ["a", "b"]})
    with pytest.raises(ValueError, match=f"^t.jsonl line 3: .*{why}"):
        list(parse_trace([good, "", line, good], block_size=16, source="t.jsonl"))


def test_a_prompt_shorter_than_one_block_lists_no_blocks_and_counts_its_tokens() -> None:
    (short,) = parse_trace(['{"blocks": [], "tokens": 5}'], block_size=16)
    assert (short.prompt_blocks, short.prompt_tokens) == ((), 5)


def test_the_same_block_in_two_requests_is_sharing_not_a_repeat() -> None:
    first, second = parse_trace(['{"blocks": ["a", "b"]}', '{"blocks": ["a", "c"], "output_blocks": ["d"]}'])
    assert first.prompt_blocks[0] == second.prompt_blocks[0]


def test_a_timestamp_is_accepted_and_changes_nothing() -> None:
    plain = list(parse_trace(['{"id": "r", "blocks": ["a"]}', '{"id": "s", "blocks": ["a", "b"]}']))
    stamped = list(parse_trace([
        '{"id": "r", "blocks": ["a"], "timestamp": 1733011200.25}',
        '{"id": "s", "blocks": ["a", "b"], "timestamp": "2026-12-01T00:00:01Z"}',
    ]))  # fmt: skip
    assert stamped == plain


def test_read_trace_reads_a_gzip_compressed_trace_whatever_its_name(tmp_path: Path) -> None:
    import gzip

    text = '{"blocks": ["a"]}\n{"blocks": ["a", "b"]}\n'
    for name in ("trace.jsonl.gz", "trace.jsonl"):
        path = tmp_path / name
        path.write_bytes(gzip.compress(text.encode()))
        assert [len(r.prompt_blocks) for r in read_trace(path)] == [1, 2]


def test_a_truncated_gzip_trace_says_it_does_not_decompress(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"blocks": ["a"]}\n' * 100)[:20])
    with pytest.raises(ValueError, match=f"^{path}: gzip-compressed, but it does not decompress"):
        read_trace(path)


def test_read_trace_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"blocks": ["a"]}\n{"blocks": ["a", "b"]}\n{"blocks": [}\n')
    with pytest.raises(ValueError, match=f"^{path} line 3: not valid JSON"):
        read_trace(path)


def test_read_trace_rejects_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="the trace holds no requests"):
        read_trace(path)


def test_read_trace_accepts_a_utf8_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "excel.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"blocks": ["a"]}\n{"blocks": ["a", "b"]}\n')
    assert [len(r.prompt_blocks) for r in read_trace(path)] == [1, 2]


def test_read_trace_rejects_binary_files(tmp_path: Path) -> None:
    path = tmp_path / "trace.bin"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        read_trace(path)


def test_read_trace_round_trips_a_written_trace(tmp_path: Path) -> None:
    requests = generate("shared-prompt", seed=4, block_size=16, overrides={"requests": "5"})
    path = tmp_path / "trace.jsonl"
    with path.open("w") as handle:
        for request in requests:
            record = {
                "id": request.req_id,
                "blocks": [block.hex() for block in request.prompt_blocks],
                "tokens": request.prompt_tokens,
                "output_blocks": [block.hex() for block in request.output_blocks],
            }
            handle.write(json.dumps(record) + "\n")
    loaded = read_trace(path, block_size=16)
    assert [r.req_id for r in loaded] == [r.req_id for r in requests]
    assert [len(r.prompt_blocks) for r in loaded] == [len(r.prompt_blocks) for r in requests]
    assert [r.prompt_tokens for r in loaded] == [r.prompt_tokens for r in requests]


# --------------------------------------------------------------------------
# The four workloads of the vLLM-order measurements


def small(name: str, **overrides: int | float) -> list[Request]:
    return generate(name, seed=3, block_size=16, overrides={"requests": 200, **overrides})


def test_system_prompts_share_whole_prompts_and_end_in_unique_blocks() -> None:
    requests = small("system-prompts", system_prompts=5)
    counts = collections.Counter(block for request in requests for block in request.prompt_blocks)
    for request in requests:
        shared = [block for block in request.prompt_blocks if counts[block] > 1]
        # Shared blocks are a prefix (the system prompt); the user message is unique.
        assert request.prompt_blocks[: len(shared)] == tuple(shared)
    heads = collections.Counter(request.prompt_blocks[0] for request in requests)
    assert len(heads) <= 5
    ((_, top_count),) = heads.most_common(1)
    assert top_count > len(requests) / 5  # Zipf: the first prompt is more popular than a uniform pick


def test_multi_turn_resends_the_history_and_the_last_answer() -> None:
    requests = small("multi-turn", active_conversations=1, turns_min=3, turns_max=3)
    first, second = requests[0], requests[1]
    assert first.req_id.endswith("turn-0") and second.req_id.endswith("turn-1")
    history = first.prompt_blocks + first.output_blocks
    assert second.prompt_blocks[: len(history)] == history


def test_prefix_tree_prompts_are_a_header_then_the_first_k_examples() -> None:
    requests = small(
        "prefix-tree", tasks=1, examples_per_task=4, header_tokens=64, example_tokens_min=32, example_tokens_max=32
    )
    # One task: every prompt starts with the 4 header blocks, then k of the 8 example blocks.
    header = requests[0].prompt_blocks[:4]
    longest = max(requests, key=lambda request: len(request.prompt_blocks)).prompt_blocks
    for request in requests:
        assert request.prompt_blocks[:4] == header
        shared = 0
        while shared < len(request.prompt_blocks) and request.prompt_blocks[shared] == longest[shared]:
            shared += 1
        assert (shared - 4) % 2 == 0 or shared == len(request.prompt_blocks)  # whole examples of 2 blocks


def test_scan_documents_are_never_reused_and_hot_prompts_are() -> None:
    requests = small("scan", scan_fraction=0.3)
    counts = collections.Counter(block for request in requests for block in request.prompt_blocks)
    documents = [request for request in requests if request.req_id.startswith("scan-document")]
    hot = [request for request in requests if request.req_id.startswith("scan-hot")]
    assert documents and hot
    assert all(counts[block] == 1 for request in documents for block in request.prompt_blocks)
    assert any(counts[request.prompt_blocks[0]] > 1 for request in hot)


@pytest.mark.parametrize("name", ["system-prompts", "multi-turn", "prefix-tree", "scan"])
def test_new_workloads_are_deterministic_per_seed(name: str) -> None:
    assert small(name) == small(name)
    assert small(name) != generate(name, seed=4, block_size=16, overrides={"requests": 200})


def test_scan_fraction_out_of_range_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="scan_fraction must be in 0..1, got 1.5"):
        generate("scan", overrides={"scan_fraction": "1.5"})


def test_a_trace_header_records_its_block_size_and_another_is_refused() -> None:
    lines = [
        "# 2 requests, 16 tokens per block, written by kvtriton.sim._token_trace",
        '{"blocks": ["a"], "tokens": 20}',
    ]
    assert [request.prompt_tokens for request in parse_trace(lines, block_size=16)] == [20]
    with pytest.raises(TraceBlockSizeMismatch) as raised:
        list(parse_trace(lines, block_size=32, source="t.jsonl"))
    assert (raised.value.written, raised.value.read_at, raised.value.from_header) == (16, 32, lines[0])
    assert str(raised.value) == ("t.jsonl line 1: written at 16 tokens per block, not 32; read it at 16")
    # A comment after the first request is only a comment.
    assert len(list(parse_trace([lines[1], "# 99 tokens per block"], block_size=16))) == 1


def test_a_line_whose_tokens_fit_one_likely_block_size_names_it() -> None:
    with pytest.raises(TraceBlockSizeMismatch) as raised:
        list(parse_trace(['{"blocks": ["a", "b", "c"], "tokens": 56}'], block_size=32, source="t.jsonl"))
    assert (raised.value.written, raised.value.from_header) == (16, None)
    assert str(raised.value) == (
        "t.jsonl line 1: tokens = 56 does not fit 3 full blocks of 32 tokens (expected 96..127); it fits 16 tokens"
        " per block: read it at 16 if it was written so"
    )
    # 3 blocks and 40 tokens fit 10..13 tokens per block: no likely size, so the plain reason alone.
    with pytest.raises(
        ValueError, match=r"^t.jsonl line 1: tokens = 40 does not fit 3 full blocks of 32 tokens \(expected 96..127\)$"
    ):
        list(parse_trace(['{"blocks": ["a", "b", "c"], "tokens": 40}'], block_size=32, source="t.jsonl"))
