"""The prompts (token ids) and block size the end-to-end tests share."""

from __future__ import annotations

BLOCK_SIZE = 32
"""vLLM's CPU attention takes block sizes that are multiples of 32."""
PROMPT_A = list(range(10, 10 + 4 * BLOCK_SIZE + 5))
"""4 full blocks of 32 (2 of 64) and a partial one."""
MAX_TOKENS = 6
