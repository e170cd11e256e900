"""vLLM ``Request`` objects as the engine builds them for a prompt, for tests that drive vLLM's scheduler."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

BLOCK_SIZE = 16
"""Tokens per GPU block in every toy model these fixtures build."""
EOS = 2
"""The toy models' end-of-sequence token (never sampled: requests generate one token)."""


def make_request(request_id: str, prompt: list[int], *, block_size: int = BLOCK_SIZE) -> Request:
    """A request for ``prompt`` generating one token, its blocks hashed with sha256 as vLLM's prefix cache does."""
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
