"""The compression benchmark's tiny-model measurement: exact where nothing is lost, ordered where something is."""

from __future__ import annotations

import pytest
import torch

from bench.compression import Scheme, group_fp8_any, in_page_order, per_tensor_fp8, tiny_model_figures


def _identity(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.clone(), torch.zeros_like(x)


@pytest.mark.parametrize("channel_major", [True, False])
def test_page_order_puts_every_element_back_where_it_was(channel_major: bool) -> None:
    x = torch.randn(1, 2, 64, 32)
    decoded, _ = in_page_order(_identity, 32, channel_major=channel_major)(x)
    assert torch.equal(decoded, x)


def test_page_order_groups_a_k_page_channel_by_channel_and_a_v_page_token_by_token() -> None:
    x = torch.randn(1, 2, 64, 32)  # (1, heads, tokens, dim): two blocks of 32 tokens
    _, by_channel = in_page_order(group_fp8_any(32), 32, channel_major=True)(x)
    _, by_token = in_page_order(group_fp8_any(32), 32, channel_major=False)(x)
    blocks = by_channel.reshape(2, 2, 32, 32)  # (head, block, token, dim)
    # One scale per channel of a block (constant along its tokens), different between channels.
    assert torch.equal(blocks, blocks[:, :, :1, :].expand_as(blocks))
    assert not torch.equal(blocks[..., 0], blocks[..., 1])
    # One scale per token's head vector (constant along the dims).
    assert torch.equal(by_token, by_token[..., :1].expand_as(by_token))
    assert not torch.equal(by_token[..., 0, :], by_token[..., 1, :])


def test_tiny_model_is_exact_without_loss_and_group_fp8_beats_a_per_tensor_scale() -> None:
    pytest.importorskip("transformers")
    schemes: dict[str, tuple[Scheme, Scheme]] = {
        "exact": (_identity, _identity),
        "group": (group_fp8_any(32), group_fp8_any(32)),
        "per-tensor": (per_tensor_fp8, per_tensor_fp8),
    }
    figures = tiny_model_figures(schemes, 2, torch.Generator().manual_seed(0))
    assert not isinstance(figures, str)
    exact = figures["exact"]
    assert exact["top1_agreement"] == 1.0 and exact["max_abs_logprob_drift"] == 0.0
    assert exact["attention_relative_error"] == 0.0 and exact["k_relative_rms_error"] == 0.0
    for lossy in ("group", "per-tensor"):
        assert 0.005 < figures[lossy]["k_relative_rms_error"] < 0.05
        assert figures[lossy]["mean_kl_nats"] > 0
    assert figures["group"]["k_relative_rms_error"] < figures["per-tensor"]["k_relative_rms_error"]
