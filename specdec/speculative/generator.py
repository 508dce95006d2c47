"""SpeculativeGenerator: the speculative loop in process — admit, then speculative steps until every request stops.

    gen = SpeculativeGenerator(target_engine, NgramDrafter(), gamma=4)          # coupled for sampled requests
    outs = gen.generate([GenRequest(prompt_ids, SamplingParams(temperature=0.7), max_tokens=64)])

The services (target_service) drive the same `speculative_step` from their scheduler; this class is the library's
own loop, used by the CLI, the benchmarks and the exactness tests.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Callable, TextIO

from ..engine.engine import Engine
from .accept import Mode
from .propose import Drafter
from .sampling import SamplingParams
from .step import Planner, RequestStats, SpecRequest, StepInfo, plan_full, speculative_step
from .validation import EMBEDDED, Capabilities, assign_seed, validate_request


@dataclasses.dataclass
class GenRequest:
    prompt: list[int]
    params: SamplingParams = SamplingParams()
    max_tokens: int = 64
    stop_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()             # stop strings (need a tokenizer); the output text ends before them
    gamma: int | None = None               # None: the generator's default
    mode: str | Mode | None = None         # acceptance for non-greedy requests; None: the generator's default
    rid: str | None = None


@dataclasses.dataclass
class GenOutput:
    rid: str
    tokens: list[int]
    finish_reason: str
    seed: int | None
    mode: Mode
    stats: RequestStats
    text: str | None = None

    @property
    def tokens_per_step(self) -> float:
        return self.stats.tokens_per_step(len(self.tokens))


class TraceWriter:
    """JSONL, one record per request per verify step; `t`: when the step's record was written (wall clock, seconds),
    so the time between steps (admission, streaming, the store) shows beside the step's own phases."""

    def __init__(self, f: TextIO):
        self.f, self.step = f, 0

    def write(self, reqs: list[SpecRequest], info: StepInfo, commit_ms: float | None = None) -> None:
        t = time.time()
        for i, r in enumerate(reqs):
            self.f.write(json.dumps({
                "step": self.step, "t": round(t, 4), "request": r.rid, "batch": len(reqs), "gamma": r.gamma,
                "verify_len": info.verify_len[i], "layout_rows": info.rows, "accepted": info.accepted[i],
                "emitted": len(info.emitted[i]),
                "mode": r.mode.value, "seeded": r.params.seed is not None, "draft_ok": info.draft_ok,
                "draft_ms": round(info.draft_ms, 3), "verify_ms": round(info.verify_ms, 3),
                "accept_ms": round(info.accept_ms, 3),
                "commit_ms": None if commit_ms is None else round(commit_ms, 3)}) + "\n")
        self.step += 1


class SpeculativeGenerator:
    def __init__(self, target: Engine, drafter: Drafter | None, *, gamma: int = 4, mode: str | Mode | None = None,
                 layout: str = "compact", tokenizer=None, plan: Planner = plan_full, trace: TextIO | None = None,
                 caps: Capabilities = EMBEDDED, tree_rows: int = 0):
        # mode None: the capability table's default (coupled: output = plain seeded decoding, whatever the drafter)
        self.target, self.drafter, self.gamma = target, drafter, gamma
        self.mode = Mode(caps.default_acceptance if mode is None else mode)
        self.layout, self.tokenizer, self.plan, self.caps = layout, tokenizer, plan, caps
        self.tree_rows = tree_rows           # leaf rows a step may add beside the chains (speculative/tree.py)
        self.trace = TraceWriter(trace) if trace else None
        self.steps: list[StepInfo] = []

    def admit(self, g: GenRequest) -> SpecRequest:
        """Validate (before anything is allocated), choose a seed if needed, and prefill all but the anchor."""
        gamma = self.gamma if g.gamma is None else g.gamma
        mode = self.mode if g.mode is None else g.mode
        validate_request(g.prompt, g.params, g.max_tokens, gamma, mode, self.caps, self.target.vocab_size,
                         self.target.cfg.max_seq_len, stop=g.stop)
        params = assign_seed(g.params)
        return SpecRequest(g.rid or uuid.uuid4().hex, list(g.prompt), params, g.max_tokens,
                           Mode.GREEDY if params.greedy else Mode(mode), gamma, frozenset(g.stop_ids))

    def generate(self, requests: list[GenRequest],
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[GenOutput]:
        reqs = [self.admit(g) for g in requests]          # all validated before any KV is taken
        texts: list[str | None] = [None] * len(reqs)
        try:
            for r in reqs:
                r.seq = self.target.new_sequence()
            pre = [(r.seq, r.prompt[:-1]) for r in reqs if len(r.prompt) > 1]
            if pre:
                self.target.prefill([s for s, _ in pre], [p for _, p in pre])
            active = list(range(len(reqs)))
            while active:
                info = speculative_step(self.target, self.drafter, [reqs[i] for i in active], layout=self.layout,
                                        plan=self.plan, tree_rows=self.tree_rows)
                self.steps.append(info)
                if self.trace:
                    self.trace.write([reqs[i] for i in active], info)
                for i, toks in zip(active, info.emitted):
                    if requests[i].stop and self._hit_stop(reqs[i], requests[i].stop, texts, i):
                        reqs[i].finish_reason = "stop"
                    if on_tokens and toks:
                        on_tokens(i, toks)
                active = [i for i in active if reqs[i].finish_reason is None]
        finally:
            for r in reqs:
                if r.seq >= 0:
                    self.target.release(r.seq)
                if self.drafter is not None:
                    self.drafter.release(r.rid)
        return [GenOutput(r.rid, r.output, r.finish_reason, r.params.seed, r.mode, r.stats,
                          texts[i] if texts[i] is not None else
                          (self.tokenizer.decode(r.output) if self.tokenizer else None))
                for i, r in enumerate(reqs)]

    def _hit_stop(self, r: SpecRequest, stops: tuple[str, ...], texts: list, i: int) -> bool:
        text = self.tokenizer.decode(r.output)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            texts[i] = text[:min(hits)]
        return bool(hits)
