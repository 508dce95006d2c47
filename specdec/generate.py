"""Target-only decoding: the baseline every speculative run is compared with, and the definition of "the output" a
seeded request must reproduce. A batch of requests is prefilled together, then decoded one row each per forward."""
from __future__ import annotations

import dataclasses
from typing import Callable

from .engine.engine import Engine
from .engine.layout import SeqInput
from .speculative.sampling import SamplingParams, next_token
from .speculative.validation import assign_seed, validate_prompt, validate_sampling


@dataclasses.dataclass
class Request:
    prompt: list[int]
    params: SamplingParams = SamplingParams()
    max_tokens: int = 64
    stop_ids: frozenset[int] = frozenset()


@dataclasses.dataclass
class Output:
    tokens: list[int]
    finish_reason: str            # "stop" | "length"
    seed: int | None


def generate(engine: Engine, requests: list[Request],
             on_token: Callable[[int, int], None] | None = None) -> list[Output]:
    """Decode every request to EOS/stop id or max_tokens. on_token(request index, token) streams."""
    for r in requests:  # everything is checked before any KV is taken
        validate_sampling(r.params)
        validate_prompt(r.prompt, r.max_tokens, engine.vocab_size, engine.cfg.max_seq_len)
    params = [assign_seed(r.params) for r in requests]
    outs = [Output([], "length", p.seed) for p in params]
    seqs = [engine.new_sequence() for _ in requests]
    try:
        logits = list(engine.prefill(seqs, [r.prompt for r in requests]))
        active = list(range(len(requests)))
        while active:
            still = []
            for j, i in enumerate(active):
                r, out = requests[i], outs[i]
                tok = next_token(logits[j], params[i], position=len(r.prompt) + len(out.tokens))
                out.tokens.append(tok)
                if on_token:
                    on_token(i, tok)
                if tok in r.stop_ids:
                    out.finish_reason = "stop"
                elif len(out.tokens) < r.max_tokens:
                    still.append(i)
            active = still
            if active:
                fwd = engine.forward([SeqInput(seqs[i], [outs[i].tokens[-1]]) for i in active])
                logits = [fwd.rows(j)[-1] for j in range(len(active))]
    finally:
        for s in seqs:
            engine.release(s)
    return outs
