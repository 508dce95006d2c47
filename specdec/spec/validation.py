"""Request validation in one place: a request the backend cannot honour exactly is refused before any state is
written, with a message naming the field, the value and the remedy."""
from __future__ import annotations

import math

from ..errors import InvalidRequest
from .sampling import SamplingParams


def validate_sampling(p: SamplingParams) -> None:
    def bad(field, value, rule):
        raise InvalidRequest(f"{value!r} is out of range: {rule}", field=field)

    if not isinstance(p.temperature, (int, float)) or math.isnan(p.temperature) or not 0 <= p.temperature <= 100:
        bad("temperature", p.temperature, "use 0 (greedy) or a value in (0, 100]")
    if not isinstance(p.top_k, int) or p.top_k < 0:
        bad("top_k", p.top_k, "use 0 (off) or a positive integer")
    if not isinstance(p.top_p, (int, float)) or math.isnan(p.top_p) or not 0 < p.top_p <= 1:
        bad("top_p", p.top_p, "use a value in (0, 1]")
    if not isinstance(p.min_p, (int, float)) or math.isnan(p.min_p) or not 0 <= p.min_p < 1:
        bad("min_p", p.min_p, "use a value in [0, 1)")
    if p.seed is not None and (not isinstance(p.seed, int) or not 0 <= p.seed < 2**63):
        bad("seed", p.seed, "use an integer in [0, 2^63)")


def validate_prompt(prompt: list[int], max_tokens: int, vocab_size: int, context: int) -> None:
    if not prompt:
        raise InvalidRequest("the prompt is empty", field="prompt", remedy="send at least one token")
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})", field="prompt")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidRequest(f"{max_tokens!r} is out of range", field="max_tokens", remedy="use a positive integer")
    if len(prompt) >= context:
        raise InvalidRequest(f"the prompt has {len(prompt)} tokens; the model context is {context}", field="prompt",
                             remedy="shorten the prompt")
    if len(prompt) + max_tokens > context:
        raise InvalidRequest(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the model context "
                             f"of {context}", field="max_tokens",
                             remedy=f"use max_tokens <= {context - len(prompt)}")
