"""Request validation in one place: a request the backend cannot honour exactly is refused before any state is
written, with a message naming the field, the value and the remedy."""
from __future__ import annotations

import dataclasses
import math
import secrets

from ..errors import InvalidRequest
from .sampling import SamplingParams

# Below this (and above 0) logits / T overflow to inf and the distribution becomes NaN; 0 is how to ask for greedy.
MIN_TEMPERATURE = 1e-6


def validate_sampling(p: SamplingParams) -> None:
    def bad(field, value, rule):
        raise InvalidRequest(f"{value!r} is out of range: {rule}", field=field)

    if not isinstance(p.temperature, (int, float)) or math.isnan(p.temperature) or not 0 <= p.temperature <= 100 \
            or 0 < p.temperature < MIN_TEMPERATURE:
        bad("temperature", p.temperature, "use 0 (greedy) or a value in [1e-6, 100]")
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


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can honour exactly. A request needing more is refused, never silently degraded."""
    backend: str
    seeded_sampling: bool = True           # per-request seeded non-greedy sampling (the replay guarantee)
    acceptance_modes: tuple[str, ...] = ("greedy", "rejection", "coupled")
    # for seeded non-greedy requests that name none: coupled output is plain seeded decoding's, whatever the step
    # structure; rejection (opt-in) accepts a few % more drafts but its text depends on the proposals
    default_acceptance: str = "coupled"
    top_k: bool = True
    top_p: bool = True
    min_p: bool = True
    max_gamma: int = 16
    max_stop: int = 16


EMBEDDED = Capabilities("embedded")
# A target that cannot sample per request from a seed (e.g. an external engine with batch-global RNG).
UNSEEDED = Capabilities("unseeded", seeded_sampling=False, acceptance_modes=("greedy", "rejection"), min_p=False,
                        default_acceptance="rejection")   # coupled needs the seed


def validate_request(prompt: list[int], params: SamplingParams, max_tokens: int, gamma: int, mode: str,
                     caps: Capabilities, vocab_size: int, context: int, stop: tuple[str, ...] = ()) -> None:
    """Every check a request must pass before any state is written (KV, draft session, store)."""
    validate_sampling(params)
    validate_prompt(prompt, max_tokens, vocab_size, context)
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= caps.max_gamma:
        raise InvalidRequest(f"{gamma!r} is out of range", field="gamma",
                             remedy=f"use 1..{caps.max_gamma}, or turn speculation off")
    m = getattr(mode, "value", mode)
    if m not in caps.acceptance_modes:
        raise InvalidRequest(f"acceptance mode {m!r} is not supported by the {caps.backend} backend", field="acceptance",
                             remedy=f"use one of {', '.join(caps.acceptance_modes)}")
    if not params.greedy:
        if params.seed is not None and not caps.seeded_sampling:
            raise InvalidRequest(f"seeded sampling (seed={params.seed}, temperature={params.temperature}) cannot be "
                                 f"honoured exactly by the {caps.backend} backend", field="seed",
                                 remedy="use temperature=0, drop the seed, or use a backend with per-request seeded "
                                        "sampling (the embedded engine)")
        for name, on, off in (("top_k", params.top_k, 0), ("top_p", params.top_p, 1.0), ("min_p", params.min_p, 0.0)):
            if on != off and not getattr(caps, name):
                raise InvalidRequest(f"{name}={on!r} is not supported by the {caps.backend} backend", field=name,
                                     remedy=f"leave {name} unset")
    if not isinstance(stop, (list, tuple)) or len(stop) > caps.max_stop:
        raise InvalidRequest(f"{len(stop) if isinstance(stop, (list, tuple)) else stop!r} stop strings", field="stop",
                             remedy=f"send at most {caps.max_stop}")
    for s in stop:
        if not isinstance(s, str) or not 0 < len(s) <= 256:
            raise InvalidRequest(f"stop string {s!r} must be a non-empty string of at most 256 characters",
                                 field="stop")


def assign_seed(params: SamplingParams, caps: Capabilities = EMBEDDED) -> SamplingParams:
    """Non-greedy requests without a seed get one now (reported back), so every request is replayable."""
    if params.greedy or params.seed is not None or not caps.seeded_sampling:
        return params
    return dataclasses.replace(params, seed=secrets.randbelow(2**63))
