"""The pure-torch stand-ins for vLLM 0.34's CPU ops, each against cases worked out by hand from its C++ kernel.

The functions are called directly (no vLLM needed, so these run on vLLM 0.33 too). The last tests
check the registration: the import hook in a fresh interpreter, and, on a vLLM that calls the ops,
each op through ``torch.ops._C`` with its schema.
"""

from __future__ import annotations

import math
import struct
import subprocess
import sys
from typing import Any

import pytest
import torch

from e2e import vllm_cpu_ops as ops
from e2e.engine import TESTS, engine_env

PAD = -1
I32 = torch.int32
I64 = torch.int64


def _i32(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def _i64(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=I64)


def _list(tensor: torch.Tensor) -> Any:
    """``tensor.tolist()``: nested lists of Python numbers (Any: torch types it as a list of Unknown)."""
    return tensor.tolist()  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType] -- see the docstring


# --- gather_block_table_cpu ---------------------------------------------------------------------------------


def test_gather_block_table_copies_each_requests_blocks_and_zeroes_the_padding_rows() -> None:
    block_table = _i32([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    output = torch.full((4, 4), 99, dtype=I32)
    ops.gather_block_table_cpu(block_table, output, _i64([2, 0]), _i32([3, 0, 2]), 3)
    assert _list(output) == [
        [9, 10, 99, 99],  # request 2's 2 blocks; the rest of the row is left as it was
        [1, 2, 3, 99],  # request 0's 3 blocks
        [0, 0, 0, 0],  # padding row
        [99, 99, 99, 99],  # past num_reqs_padded: untouched
    ]


def test_gather_block_table_of_an_empty_batch_zeroes_only_the_padding_rows() -> None:
    output = torch.full((3, 2), 99, dtype=I32)
    ops.gather_block_table_cpu(_i32([[1, 2]]), output, _i64([]), _i32([2]), 2)
    assert _list(output) == [[0, 0], [0, 0], [99, 99]]


# --- compute_slot_mapping_cpu -------------------------------------------------------------------------------


def test_compute_slot_mapping_maps_positions_through_the_block_table_and_pads_the_rest() -> None:
    block_table = _i32([[7, 3, 0], [2, 5, 0]])
    slot_mapping = torch.full((8,), 123, dtype=I64)
    # Request 1 has 3 tokens at positions 2..4, request 0 one token at position 5 (block size 4).
    ops.compute_slot_mapping_cpu(
        block_table, slot_mapping, _i64([1, 0]), _i32([0, 3, 4]), _i64([2, 3, 4, 5, 0, 0, 0, 0]), 4, True, PAD
    )
    # position 2 -> block 2 * 4 + 2; 3 -> 2 * 4 + 3; 4 -> block 5 * 4 + 0; request 0, 5 -> block 3 * 4 + 1
    assert _list(slot_mapping) == [10, 11, 20, 13, PAD, PAD, PAD, PAD]


def test_compute_slot_mapping_pads_a_request_without_a_state_and_every_token_when_disabled() -> None:
    block_table = _i32([[4, 4]])
    slot_mapping = torch.zeros(4, dtype=I64)
    ops.compute_slot_mapping_cpu(
        block_table, slot_mapping, _i64([-1, 0]), _i32([0, 2, 3]), _i64([0, 1, 1, 9]), 2, True, PAD
    )
    assert _list(slot_mapping) == [PAD, PAD, 9, PAD]
    ops.compute_slot_mapping_cpu(block_table, slot_mapping, _i64([0]), _i32([0, 1]), _i64([0, 0, 0, 0]), 2, False, PAD)
    assert _list(slot_mapping) == [PAD] * 4


def test_compute_slot_mapping_of_an_empty_batch_pads_everything() -> None:
    slot_mapping = torch.zeros(3, dtype=I64)
    ops.compute_slot_mapping_cpu(_i32([[1]]), slot_mapping, _i64([]), _i32([0]), _i64([0, 0, 0]), 16, True, PAD)
    assert _list(slot_mapping) == [PAD] * 3


# --- prepare_prefill_inputs_cpu -----------------------------------------------------------------------------


def test_prepare_prefill_inputs_copies_the_scheduled_prompt_tokens_and_the_next_one() -> None:
    all_token_ids = _i32([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35]])
    input_ids = torch.full((7,), -5, dtype=I32)
    next_prefill_tokens = torch.full((1, 3), -5, dtype=I32)
    # Batch: request 0 (prefill 6, 2 computed, 3 scheduled), request 2 (decoding: prefill 4, 4 computed),
    # request 1 (prefill 4, 1 computed, 3 scheduled: reaches the end of its prompt).
    ops.prepare_prefill_inputs_cpu(
        input_ids,
        next_prefill_tokens,
        _i64([0, 2, 1]),
        _i32([0, 3, 4, 7]),
        all_token_ids,
        _i32([6, 4, 4]),
        _i32([2, 1, 4]),
    )
    assert _list(input_ids) == [12, 13, 14, -5, 21, 22, 23]
    assert _list(next_prefill_tokens) == [[15, 0, -5]]


def test_prepare_prefill_inputs_fills_one_row_per_lookahead_token() -> None:
    all_token_ids = _i32([[1, 2, 3, 4, 5]])
    input_ids = torch.zeros(1, dtype=I32)
    next_prefill_tokens = torch.full((3, 1), -5, dtype=I32)
    ops.prepare_prefill_inputs_cpu(
        input_ids, next_prefill_tokens, _i64([0]), _i32([0, 1]), all_token_ids, _i32([5]), _i32([1])
    )
    assert _list(input_ids) == [2]
    assert _list(next_prefill_tokens) == [[3], [4], [5]]


# --- get_prompt_logprobs_token_ids_cpu ----------------------------------------------------------------------


def test_prompt_logprobs_token_ids_are_each_positions_next_prompt_token() -> None:
    all_token_ids = _i32([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    token_ids = ops.get_prompt_logprobs_token_ids_cpu(5, _i32([0, 2, 4]), _i64([1, 0]), _i32([0, 2]), all_token_ids)
    assert token_ids.dtype == I64
    # Request 1 has 2 tokens computed: targets 23, 24; request 0 none: targets 11, 12; the fifth is uncovered.
    assert _list(token_ids) == [23, 24, 11, 12, 0]


# --- prepare_pos_seq_lens_cpu -------------------------------------------------------------------------------


def test_prepare_pos_seq_lens_counts_on_from_the_computed_tokens_and_zeroes_unused_lengths() -> None:
    pos = torch.full((6,), -5, dtype=I64)
    seq_lens = torch.full((4,), -5, dtype=I32)
    ops.prepare_pos_seq_lens_cpu(_i64([2, 0]), _i32([0, 3, 4]), _i32([7, 0, 10]), pos, seq_lens)
    assert _list(pos) == [10, 11, 12, 7, -5, -5]
    assert _list(seq_lens) == [13, 8, 0, 0]


def test_prepare_pos_seq_lens_of_an_empty_batch_zeroes_every_length() -> None:
    seq_lens = torch.full((2,), 9, dtype=I32)
    ops.prepare_pos_seq_lens_cpu(_i64([]), _i32([0]), _i32([3]), torch.zeros(2, dtype=I64), seq_lens)
    assert _list(seq_lens) == [0, 0]


# --- prepare_mrope_positions_cpu ----------------------------------------------------------------------------


def test_mrope_positions_take_the_prompts_precomputed_ones_then_count_on_with_the_delta() -> None:
    num_dims = 2
    # Request 0's prompt positions: dim 0 [0, 1, 2, 2], dim 1 [0, 0, 1, 1]; delta -1. Request 1: delta 5.
    prefill_positions = _i32([[0, 1, 2, 2], [0, 0, 1, 1], [9, 9, 9, 9], [9, 9, 9, 9]])
    positions = torch.full((num_dims, 6), -5, dtype=I64)
    # Request 0: 1 computed, 5 scheduled (3 prompt tokens, then 2 past the prompt). Request 1: decoding at 4.
    ops.prepare_mrope_positions_cpu(
        positions, prefill_positions, _i32([-1, 5]), _i64([0, 1]), _i32([0, 5, 6]), _i32([4, 4]), _i32([1, 4])
    )
    # Past the prompt: num_computed + index + delta = 1 + 3 - 1 and 1 + 4 - 1; request 1: 4 + 0 + 5.
    assert _list(positions) == [[1, 2, 2, 3, 4, 9], [0, 1, 1, 3, 4, 9]]


# --- combine_sampled_and_draft_tokens_cpu -------------------------------------------------------------------


def test_combine_puts_each_decoding_requests_last_token_in_and_returns_the_last_positions() -> None:
    input_ids = _i32([1, 2, 3, 4, 5])
    last_sampled = _i64([[70], [71], [72]])
    # Request 2 is decoding (seq 8 > prefill 5), request 0 finishes its prefill this step (seq 4 == prefill 4).
    logits_indices = ops.combine_sampled_and_draft_tokens_cpu(
        input_ids, _i64([2, 0]), last_sampled, _i32([0, 1, 5]), _i32([8, 4]), _i32([4, 0, 5]),
        last_sampled[:, :0], _i32([0, 1, 2]), 2, 1,
    )  # fmt: skip
    assert logits_indices.dtype == I64
    assert _list(logits_indices) == [0, 4]
    assert _list(input_ids) == [72, 2, 3, 4, 5]


def test_combine_with_draft_tokens_writes_them_after_the_sampled_one() -> None:
    input_ids = torch.zeros(4, dtype=I32)
    draft_tokens = _i64([[0, 0], [81, 82]])
    # One request (state 1) verifying 2 draft tokens: 3 logits at the end of its 4-token query.
    logits_indices = ops.combine_sampled_and_draft_tokens_cpu(
        input_ids, _i64([1]), _i64([[60], [61]]), _i32([0, 4]), _i32([20]), _i32([0, 3]),
        draft_tokens, _i32([0, 3]), 3, 1,
    )  # fmt: skip
    assert _list(logits_indices) == [1, 2, 3]
    assert _list(input_ids) == [0, 61, 81, 82]


def test_combine_without_a_new_sampled_token_writes_only_the_drafts() -> None:
    input_ids = _i32([1, 2, 3])
    # One logit, and no new sampled token: the logit is the draft token's, written at the query's end.
    logits_indices = ops.combine_sampled_and_draft_tokens_cpu(
        input_ids, _i64([0]), _i64([[60]]), _i32([0, 3]), _i32([9]), _i32([3]), _i64([[44]]), _i32([0, 1]), 1, 0
    )
    assert _list(logits_indices) == [2]
    assert _list(input_ids) == [1, 2, 44]


def test_combine_of_an_empty_batch_returns_no_indices() -> None:
    logits_indices = ops.combine_sampled_and_draft_tokens_cpu(
        torch.zeros(2, dtype=I32), _i64([]), _i64([[0]]), _i32([0]), _i32([]), _i32([0]), _i64([[0]])[:, :0],
        _i32([0]), 0, 1,
    )  # fmt: skip
    assert _list(logits_indices) == []


# --- post_update_cpu ----------------------------------------------------------------------------------------


def test_post_update_appends_the_sampled_tokens_and_advances_each_request() -> None:
    num_computed = _i32([10, 20, 30])
    last_sampled = _i64([[0], [0], [0]])
    bin_counts = torch.zeros(3, 8, dtype=I32)
    all_token_ids = torch.zeros(3, 6, dtype=I32)
    total_len = _i32([2, 3, 1])
    # Batch row 0: request 2 sampled 2 tokens (5, 5) of 3 logits, 1 rejected, query of 3.
    # Row 1: request 0 sampled none (a chunk of its prefill), query of 4. Row 2: padding (-1).
    ops.post_update_cpu(
        _i64([2, 0, -1]), num_computed, last_sampled, bin_counts, _i64([[5, 5, 7], [0, 0, 0], [1, 1, 1]]),
        _i32([2, 0, 1]), _i32([1, 0, 0]), _i32([0, 3, 7, 8]), all_token_ids, total_len,
    )  # fmt: skip
    assert _list(all_token_ids[2]) == [0, 5, 5, 0, 0, 0]
    assert _list(total_len) == [2, 3, 3]
    assert _list(last_sampled) == [[0], [0], [5]]
    assert _list(bin_counts[2]) == [0, 0, 0, 0, 0, 2, 0, 0], "a token sampled twice is counted twice"
    assert int(bin_counts.sum()) == 2
    assert _list(num_computed) == [14, 20, 32]


def test_post_update_without_query_or_counts_only_takes_the_rejected_back() -> None:
    num_computed = _i32([10])
    all_token_ids = torch.zeros(1, 3, dtype=I32)
    total_len = _i32([0])
    last_sampled = _i64([[0]])
    ops.post_update_cpu(
        _i64([0]),
        num_computed,
        last_sampled,
        None,
        _i64([[9, 8]]),
        _i32([1]),
        _i32([1]),
        None,
        all_token_ids,
        total_len,
    )
    assert (_list(num_computed), _list(total_len), _list(all_token_ids), _list(last_sampled)) == (
        [9], [1], [[9, 0, 0]], [[9]],
    )  # fmt: skip


# --- gumbel_sample_cpu --------------------------------------------------------------------------------------


def _murmur3_x86_32(data: bytes, seed: int) -> int:
    """MurmurHash3_x86_32 as Austin Appleby published it, byte-wise (the reference the hash is checked against)."""

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    h = seed
    for (k,) in struct.iter_unpack("<I", data[: len(data) // 4 * 4]):
        k = rotl(k * 0xCC9E2D51 & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    tail = data[len(data) // 4 * 4 :]
    if tail:
        k = int.from_bytes(tail, "little")
        h ^= rotl(k * 0xCC9E2D51 & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
    h ^= len(data)
    h = (h ^ (h >> 16)) * 0x85EBCA6B & 0xFFFFFFFF
    h = (h ^ (h >> 13)) * 0xC2B2AE35 & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_the_reference_murmur3_has_the_published_values() -> None:
    assert _murmur3_x86_32(b"", 0) == 0
    assert _murmur3_x86_32(b"", 1) == 0x514E28B7
    assert _murmur3_x86_32(b"test", 0) == 0xBA6BD213
    assert _murmur3_x86_32(b"Hello, world!", 1234) == 0xFAF6CDB3


@pytest.mark.parametrize(
    ("seed", "position", "domain"), [(0, 0, 0), (11, 133, 0), (-3, 7, 0x9E3779B9), (2**40 + 5, 2**33 + 1, 0)]
)
def test_the_noise_hash_is_murmur3_of_seed_position_and_token(seed: int, position: int, domain: int) -> None:
    token_ids = torch.tensor([0, 1, 2, 49151], dtype=I64)
    hashes = _list(ops.murmur3_hash32(seed, position, token_ids, domain))
    seed_bits = seed & 0xFFFFFFFFFFFFFFFF
    for token, got in zip(_list(token_ids), hashes):
        key = struct.pack("<IIII", seed_bits & 0xFFFFFFFF, seed_bits >> 32, position & 0xFFFFFFFF, token)
        assert got == _murmur3_x86_32(key, domain)


def test_the_float64_noise_is_minus_log_minus_log_of_the_53_bit_uniform() -> None:
    seed, position = 11, 40
    noise = ops.gumbel_noise(seed, position, 5, use_fp64=True)
    for token in range(5):
        low = _murmur3_x86_32(struct.pack("<IIII", seed, 0, position, token), 0)
        high = _murmur3_x86_32(struct.pack("<IIII", seed, 0, position, token), 0x9E3779B9)
        uniform = ((((high << 32) | low) >> 11) + 0.5) * 2.0**-53
        assert float(noise[token]) == pytest.approx(-math.log(-math.log(uniform)), rel=1e-14)


def test_the_float32_noise_is_minus_log_minus_log_of_the_32_bit_uniform() -> None:
    seed, position = 11, 40
    noise = ops.gumbel_noise(seed, position, 200, use_fp64=False)
    assert noise.dtype == torch.float32
    for token in range(200):
        uniform = (_murmur3_x86_32(struct.pack("<IIII", seed, 0, position, token), 0) + 0.5) * 2.0**-32
        assert float(noise[token]) == pytest.approx(-math.log(-math.log1p(-uniform)), rel=1e-5, abs=1e-6)


def _sample(
    logits: torch.Tensor, requests: list[int], temperature: list[float], *, seeds: list[int] | None = None,
    positions: list[int] | None = None, apply_temperature: bool = True, is_drafting: bool = False, use_fp64: bool = False,
) -> list[int]:  # fmt: skip
    tokens = ops.gumbel_sample_cpu(
        logits, _i64(requests), torch.tensor(temperature, dtype=torch.float32),
        _i64(seeds or [0] * len(temperature)), _i64(positions or [0] * len(requests)),
        apply_temperature, is_drafting, use_fp64,
    )  # fmt: skip
    return _list(tokens)


def test_greedy_rows_take_the_first_largest_logit_never_a_nan() -> None:
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [
            [0.0, 3.0, 1.0, 3.0],
            [nan, 1.0, 2.0, nan],
            [-inf, -inf, -inf, -inf],
            [nan, -inf, nan, -inf],
            [1.0, inf, 2.0, inf],
        ]
    )
    assert _sample(logits, [0, 0, 0, 0, 0], [0.0]) == [1, 2, 0, 0, 1]


def test_a_padding_row_is_sampled_greedily_and_other_rows_by_their_request() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]], dtype=torch.bfloat16)
    # Request 1 has a temperature so small that the scaled logits outweigh any noise: still its argmax.
    assert _sample(logits, [-1, 1], [2.0, 1e-6], seeds=[3, 3]) == [1, 1]


def test_an_empty_batch_samples_nothing() -> None:
    assert _sample(torch.zeros(0, 5), [], [1.0]) == []


def test_gumbel_samples_follow_the_softmax() -> None:
    # p(token 1) = 3 / (1 + 3): over 1000 positions of one seed, about three quarters of the tokens are 1
    # (the bounds are 3.6 standard deviations of a fair draw; the noise is a fixed hash, so the count is too).
    logits = torch.tensor([[0.0, math.log(3.0)]]).expand(1000, 2).contiguous()
    for use_fp64 in (False, True):
        tokens = _sample(logits, [0] * 1000, [1.0], seeds=[7], positions=list(range(1000)), use_fp64=use_fp64)
        assert 0.70 < sum(tokens) / 1000 < 0.80


def test_gumbel_samples_are_argmax_of_the_scaled_logits_plus_the_noise() -> None:
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    tokens = _sample(logits, [0, 0, 0], [0.5], seeds=[42], positions=[4, 5, 6])
    for row, position in enumerate([4, 5, 6]):
        noise = ops.gumbel_noise(42, position, 300, use_fp64=False)
        assert tokens[row] == int((logits[row] / 0.5 + noise).argmax())
    unscaled = _sample(logits, [0, 0, 0], [0.5], seeds=[42], positions=[4, 5, 6], apply_temperature=False)
    for row, position in enumerate([4, 5, 6]):
        assert unscaled[row] == int((logits[row] + ops.gumbel_noise(42, position, 300, use_fp64=False)).argmax())


def test_a_drafting_row_draws_the_noise_of_its_position_plus_the_salt() -> None:
    logits = torch.zeros(64, 50)
    positions = list(range(64))
    drafting = _sample(logits, [0] * 64, [1.0], seeds=[5], positions=positions, is_drafting=True)
    salted = _sample(logits, [0] * 64, [1.0], seeds=[5], positions=[p + ops.DRAFT_NOISE_SALT for p in positions])
    assert drafting == salted
    assert drafting != _sample(logits, [0] * 64, [1.0], seeds=[5], positions=positions)


def test_the_same_seed_and_position_sample_the_same_token() -> None:
    logits = torch.zeros(4, 1000)
    tokens = _sample(logits, [0, 1, 0, 2], [1.0, 1.0, 1.0], seeds=[9, 9, 10], positions=[3, 3, 3, 3])
    assert tokens[0] == tokens[1] == tokens[2]
    assert tokens[3] != tokens[0]


def test_gumbel_sample_refuses_logits_that_are_not_2d() -> None:
    with pytest.raises(ValueError, match=r"logits must be 2-D.*\(5,\)"):
        _sample(torch.zeros(5), [0], [1.0])


# --- apply_logit_bias_cpu -----------------------------------------------------------------------------------


def _bias(
    logits: torch.Tensor, requests: list[int], positions: list[int], *, allowed: list[list[int]],
    bias: list[dict[int, float]], min_lens: list[int], stops: list[list[int]], restore: list[int], check: bool,
) -> None:  # fmt: skip
    def padded(rows: list[list[int]]) -> torch.Tensor:
        width = max([len(row) for row in rows] + [1])
        return _i32([row + [0] * (width - len(row)) for row in rows])

    ops.apply_logit_bias_cpu(
        logits, _i64(requests), _i64(positions), _i32([len(row) for row in allowed]), padded(allowed),
        _i32([len(row) for row in bias]), padded([list(row) for row in bias]),
        torch.tensor([list(row.values()) + [0.0] * (4 - len(row)) for row in bias], dtype=torch.float32),
        _i32(min_lens), _i32([len(row) for row in stops]), _i32(restore), padded(stops), check,
    )  # fmt: skip


def test_allowed_tokens_mask_the_rest_and_biases_add_up() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    _bias(
        logits, [1, 0], [0, 0], allowed=[[], [3, 1]], bias=[{0: 10.0, 4: 1.0}, {1: 0.5}],
        min_lens=[0, 0], stops=[[], []], restore=[0, 0], check=False,
    )  # fmt: skip
    inf = float("inf")
    assert _list(logits) == [[-inf, 2.5, -inf, 4.0, -inf], [11.0, 2.0, 3.0, 4.0, 6.0]]


def test_a_token_biased_twice_gets_both_biases() -> None:
    logits = torch.zeros(1, 3)
    ops.apply_logit_bias_cpu(
        logits, _i64([0]), _i64([0]), _i32([0]), _i32([[0]]), _i32([2]), _i32([[2, 2]]),
        torch.tensor([[1.5, 0.25]]), _i32([0]), _i32([0]), _i32([0]), _i32([[0]]), False,
    )  # fmt: skip
    assert _list(logits) == [[0.0, 0.0, 1.75]]


def test_stop_tokens_are_masked_until_the_minimum_length() -> None:
    logits = torch.ones(3, 4)
    # min_len 6: positions 3 and 4 (lengths 4 and 5 after sampling) mask, position 5 (length 6) does not.
    _bias(logits, [0, 0, 0], [3, 4, 5], allowed=[[]], bias=[{}], min_lens=[6], stops=[[0, 2]], restore=[0], check=False)
    inf = float("inf")
    assert _list(logits) == [[-inf, 1.0, -inf, 1.0], [-inf, 1.0, -inf, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_a_row_left_all_masked_gets_its_finite_stop_logits_back_when_asked() -> None:
    inf = float("inf")
    rows = [[-inf, 2.0, -inf, -inf], [-inf, 2.0, -inf, -inf]]
    logits = torch.tensor(rows)
    # Only token 1 is finite and it is a stop token: with restore and the check, it comes back.
    _bias(logits, [0, 1], [0, 0], allowed=[[], []], bias=[{}, {}], min_lens=[9, 9], stops=[[1, 2], [1, 2]],
          restore=[1, 0], check=True)  # fmt: skip
    assert _list(logits) == [[-inf, 2.0, -inf, -inf], [-inf, -inf, -inf, -inf]]
    unchecked = torch.tensor(rows)
    _bias(unchecked, [0], [0], allowed=[[]], bias=[{}], min_lens=[9], stops=[[1, 2]], restore=[1], check=False)
    assert _list(unchecked)[0] == [-inf, -inf, -inf, -inf]


def test_a_padding_row_is_left_alone() -> None:
    logits = torch.ones(1, 3)
    _bias(logits, [-1], [0], allowed=[[2]], bias=[{0: 1.0}], min_lens=[9], stops=[[1]], restore=[0], check=False)
    assert _list(logits) == [[1.0, 1.0, 1.0]]


# --- versions and registration ------------------------------------------------------------------------------


def test_the_ops_are_registered_from_vllm_0_34_on() -> None:
    assert ops.ops_called_by("0.33.0") == []
    assert ops.ops_called_by("0.34.0") == list(ops.SCHEMAS)
    assert ops.ops_called_by("0.34.1.dev3+gabcdef") == list(ops.SCHEMAS)
    assert ops.ops_called_by("1.0.0") == list(ops.SCHEMAS)
    with pytest.raises(ValueError, match="vllm_version must start with MAJOR.MINOR, got 'nightly'"):
        ops.release_of("nightly")


def test_every_schema_names_its_op_and_has_an_implementation() -> None:
    assert set(ops.IMPLEMENTATIONS) == set(ops.SCHEMAS)
    for name, schema in ops.SCHEMAS.items():
        assert schema.startswith(f"{name}(")


def _run_in_engine_env(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=TESTS, env=engine_env(), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


HOOKED_PLATFORM = (
    "import os, e2e.vllm_cpu as check; os.environ.update(check.ENGINE_ENV)\n"
    "from e2e import vllm_cpu_ops_hook as hook\n"
    "hook.install_import_hook()\n"
    "import torch, vllm\n"
    "from vllm.platforms import current_platform\n"
    "current_platform.import_kernels()\n"
    "cls = type(current_platform)\n"
    "print('patched', getattr(cls, hook.PATCHED, False))\n"
    "print('standalone', getattr(cls, 'uses_standalone_cpu_model_runner', lambda: None)())\n"
    "from e2e.vllm_cpu_ops import SCHEMAS, ops_called_by\n"
    "print('registered', all(hasattr(torch.ops._C, name) for name in ops_called_by(vllm.__version__)))\n"
)


def test_the_import_hook_patches_vllms_cpu_platform_when_it_is_imported() -> None:
    """In a fresh interpreter: the hook (as the .pth installs it) patches CpuPlatform on import, whatever the vLLM."""
    lines = dict(line.split(" ", 1) for line in _run_in_engine_env(HOOKED_PLATFORM).splitlines())
    assert lines["patched"] == "True"
    assert lines["registered"] == "True"
    import vllm

    if ops.release_of(vllm.__version__) >= (0, 34):
        assert lines["standalone"] == "True", "on x86 without triton-cpu the standalone runner must be taken"


REGISTERED_TWICE = (
    "import os, e2e.vllm_cpu as check; os.environ.update(check.ENGINE_ENV)\n"
    "import torch\n"
    "from vllm.platforms import current_platform\n"
    "current_platform.import_kernels()\n"
    "from e2e import vllm_cpu_ops as ops\n"
    "missing = [name for name in ops.SCHEMAS if not hasattr(torch.ops._C, name)]\n"
    "print(ops.register_missing_ops('0.34.0') == missing, ops.register_missing_ops('0.34.0'))\n"
    "print(all(hasattr(torch.ops._C, name) for name in ops.SCHEMAS), ops.registered_ops() == list(ops.SCHEMAS))\n"
)


def test_only_the_ops_the_kernels_lack_are_registered_and_only_once() -> None:
    """After vLLM's kernels load: what is missing is registered, a second call registers nothing (on either vLLM)."""
    first, second = _run_in_engine_env(REGISTERED_TWICE).strip().splitlines()[-2:]
    assert first == "True []"
    assert second == "True True"


THROUGH_THE_DISPATCHER = (
    "import os, e2e.vllm_cpu as check; os.environ.update(check.ENGINE_ENV)\n"
    "import torch\n"
    "from vllm.platforms import current_platform\n"
    "current_platform.import_kernels()\n"
    "slots = torch.zeros(4, dtype=torch.int64)\n"
    "torch.ops._C.compute_slot_mapping_cpu(torch.tensor([[7, 3]], dtype=torch.int32), slots,\n"
    "    torch.tensor([0]), torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3, 4, 0, 0]), 4, True, -1)\n"
    "logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]])\n"
    "tokens = torch.ops._C.gumbel_sample_cpu(logits, torch.tensor([0, -1]), torch.tensor([0.0]), torch.tensor([1]),\n"
    "    torch.tensor([0, 0]), True, False, False)\n"
    "print(slots.tolist(), tokens.tolist())\n"
    "print(torch.ops._C.post_update_cpu.default._schema)\n"
)


def test_the_registered_ops_run_through_torch_ops_with_their_schema() -> None:
    import vllm

    if not ops.ops_called_by(vllm.__version__):
        pytest.skip(f"vLLM {vllm.__version__} calls none of the stand-in ops: they are not registered")
    slots_and_tokens, schema = _run_in_engine_env(THROUGH_THE_DISPATCHER).strip().splitlines()[-2:]
    assert slots_and_tokens == "[31, 12, -1, -1] [1, 0]"
    assert schema == f"_C::{ops.SCHEMAS['post_update_cpu']}"
