"""Benchmark arithmetic, pure functions: per-request and per-step records in, the figures of the performance method
out (DESIGN.md): alpha, AL, per-position acceptance, tokens/s, speedup, TTFT/ITL percentiles, c, r, the Leviathan
bound E(gamma) / (1 + gamma c + r) and efficiency = speedup / bound; and the same bound with the measured AL in place of
E(gamma) (bound_al, eff_al), which holds where blocks end early (a drafter's min_conf, the cost planner): there
alpha_token counts only the slots that were verified, so E(gamma) counts gamma slots no step drafted.
eff_al = decode speedup / bound_al: what a step's costs beyond the Leviathan model (verify rows dearer than a decode,
the service's own time) leave of it."""
from __future__ import annotations

import dataclasses

import numpy as np

from ..speculative.plan import leviathan_gain


@dataclasses.dataclass
class RequestRecord:
    tokens: int
    steps: int
    drafted: int
    accepted: int
    drafted_per_pos: list[int]
    accepted_per_pos: list[int]
    ttft_s: float | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)   # gaps between streamed chunks, per token


@dataclasses.dataclass
class StepRecord:
    draft_ms: float
    verify_ms: float
    other_ms: float = 0.0      # acceptance, commit, scheduling: what the service adds around draft + verify
    rows: int = 0
    batch: int = 1


def pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def _mean_attr(steps, name: str) -> float | None:
    """A per-step figure a run attaches to its steps' record (one record object shared by a run's steps), averaged
    over every step of the runs summarized together."""
    vals = [getattr(s, name) for s in steps if hasattr(s, name)]
    return float(np.mean(vals)) if vals else None


def summarize(reqs: list[RequestRecord], steps: list[StepRecord], wall_s: float, gamma: int,
              baseline: dict | None = None) -> dict:
    tokens = sum(r.tokens for r in reqs)
    req_steps = sum(r.steps for r in reqs)
    drafted, accepted = sum(r.drafted for r in reqs), sum(r.accepted for r in reqs)
    P = max([len(r.drafted_per_pos) for r in reqs] + [0])
    dpp = [sum(r.drafted_per_pos[j] for r in reqs if j < len(r.drafted_per_pos)) for j in range(P)]
    app = [sum(r.accepted_per_pos[j] for r in reqs if j < len(r.accepted_per_pos)) for j in range(P)]
    ttft = [r.ttft_s for r in reqs if r.ttft_s is not None]
    itl = [x for r in reqs for x in r.itl_s]
    n_steps = len(steps)
    # decode alone (what speculation speeds up): tokens after each request's first, over the time after it
    decode_s = sum(sum(r.itl_s) for r in reqs)
    decode_tokens = sum(r.tokens - 1 for r in reqs if r.itl_s)      # a streamed chunk may carry several tokens
    out = {
        "requests": len(reqs), "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s else 0,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
        "steps": n_steps, "request_steps": req_steps,
        "alpha": accepted / drafted if drafted else 0.0,
        "AL": tokens / req_steps if req_steps else 0.0,
        "drafted": drafted, "accepted": accepted,
        "per_position_acceptance": [a / d if d else None for a, d in zip(app, dpp)],
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
        "draft_ms_per_step": float(np.mean([s.draft_ms for s in steps])) if steps else 0.0,
        "verify_ms_per_step": float(np.mean([s.verify_ms for s in steps])) if steps else 0.0,
        "other_ms_per_step": float(np.mean([s.other_ms for s in steps])) if steps else 0.0,
        "rows_per_step": float(np.mean([s.rows for s in steps])) if steps else 0.0,
        "gamma": gamma,
        "store_round_trips_per_step": _mean_attr(steps, "store_round_trips_per_step"),
        "_itl": itl,     # raw samples for plots; dropped from the JSON
    }
    out["alpha_token"] = alpha_token(out["per_position_acceptance"])
    if baseline:
        t_step = baseline["verify_ms_per_step"] + baseline["other_ms_per_step"]  # one target-only step
        c = out["draft_ms_per_step"] / gamma / baseline["verify_ms_per_step"] if baseline["verify_ms_per_step"] else 0
        r = (out["other_ms_per_step"] - baseline["other_ms_per_step"]) / baseline["verify_ms_per_step"] \
            if baseline["verify_ms_per_step"] else 0
        cost = 1 + gamma * c + max(0.0, r)                    # a step, in target steps, as the bound prices it
        bound = leviathan_gain(out["alpha_token"], gamma) / cost
        speedup = out["tokens_per_s"] / baseline["tokens_per_s"] if baseline["tokens_per_s"] else 0
        # decode speedup where both runs have it: the model prices decode steps alone, and the prefill (the same for
        # both, plus a draft model's own) would dilute it
        dec, base_dec = out["decode_tokens_per_s"], baseline.get("decode_tokens_per_s")
        decode_speedup = dec / base_dec if dec and base_dec else None
        bound_al = out["AL"] / cost
        out.update(c=c, r=r, bound=bound, speedup=speedup, efficiency=speedup / bound if bound else 0,
                   decode_speedup=decode_speedup, bound_al=bound_al,
                   eff_al=(decode_speedup or speedup) / bound_al if bound_al else 0, baseline_step_ms=t_step)
    return out


def alpha_token(per_pos: list) -> float:
    """Leviathan's per-token alpha. Every verified slot is counted, so per-position acceptance is
    a_j = P(slots 1..j all accepted) = alpha^j under the iid model; alpha is the mean of a_1 and a_j / a_{j-1}."""
    rates = [a for a in per_pos if a is not None]
    if not rates:
        return 0.0
    cond = [rates[0]] + [rates[j] / rates[j - 1] for j in range(1, len(rates)) if rates[j - 1] > 0]
    return float(min(1.0, np.mean(cond)))
