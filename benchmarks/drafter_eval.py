"""Acceptance and calibration of drafters on held-out prompts (issue K): per-position acceptance, accepted length,
and confidence vs measured acceptance (the reliability of the per-slot confidence the planner uses).

    .venv/bin/python benchmarks/drafter_eval.py --drafters block,block:DIR/eagle,ngram --prompts chat,humaneval \
        -n 16 --gamma 8 --max-tokens 64 --plot runs/drafter

Every draft is verified (plan_full) so every slot up to the first rejection is observed; greedy unless
--temperature (coupled acceptance, seeded). Speed is `specdec bench`'s job (interleaved with the baseline).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec.bench.prompts import encode, load_prompts
from specdec.draft import make_drafter
from specdec.engine.engine import Engine
from specdec.engine.registry import load
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.sampling import SamplingParams
from specdec.speculative.step import plan_full

BINS = 10


class Recorder:
    """A planner that verifies everything (plan_full) and records, per verified slot reached, (slot, confidence,
    accepted): slot j is reached when slots before it were accepted."""

    def __init__(self):
        self.rows: list[tuple[int, float, bool]] = []
        self.steps = self.tokens = 0

    def __call__(self, reqs, props):
        return plan_full(reqs, props)

    def observe(self, reqs, props, vlen, accepted, **_):
        for p, v, a in zip(props, vlen, accepted):
            self.steps += 1
            self.tokens += a + 1
            for j, c in enumerate(p.confidence[:v - 1]):
                if j > a:
                    break
                self.rows.append((j, float(c), j < a))


def summarize(rec: Recorder, gamma: int) -> dict:
    reached = [0] * gamma
    acc = [0] * gamma
    bins = [[0, 0, 0.0] for _ in range(BINS)]        # tried, accepted, sum of confidence
    for j, c, ok in rec.rows:
        reached[j] += 1
        acc[j] += ok
        b = bins[min(BINS - 1, int(c * BINS))]
        b[0] += 1
        b[1] += ok
        b[2] += c
    return {"AL": rec.tokens / max(1, rec.steps), "steps": rec.steps,
            "per_position_acceptance": [a / r if r else None for a, r in zip(acc, reached)],
            # conditional on reaching the slot; the unconditional rate of slot j is the product up to j
            "per_position_reached": reached,
            "calibration": [{"confidence": b[2] / b[0], "accepted": b[1] / b[0], "n": b[0]} for b in bins if b[0]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafters", default="block,ngram", help="comma-separated; block:DIR for a checkpoint")
    ap.add_argument("--prompts", default="chat,humaneval")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default="runs/drafter_eval.json")
    ap.add_argument("--plot", default=None, help="directory for PNG plots")
    a = ap.parse_args(argv)
    lm = load(a.target)
    params = SamplingParams(temperature=a.temperature, seed=1 if a.temperature else None)
    results: dict = {}
    for pset in a.prompts.split(","):
        prompts = [encode(lm.tokenizer, it) for it in load_prompts(pset, a.n)]
        for name in a.drafters.split(","):
            kind, _, ckpt = name.partition(":")
            d = make_drafter(kind, lm.model, checkpoint=ckpt or None)
            rec = Recorder()
            gen = SpeculativeGenerator(Engine(lm.model, kv_tokens=65536), d, gamma=a.gamma, plan=rec)
            gen.generate([GenRequest(p, params, a.max_tokens) for p in prompts])
            getattr(d, "close", lambda: None)()
            s = summarize(rec, a.gamma)
            results[f"{pset}/{name}"] = s
            print(f"{pset:>10} {name:<40} AL {s['AL']:.2f}  per-position "
                  f"{[round(x, 2) if x is not None else None for x in s['per_position_acceptance']]}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    print(f"wrote {a.out}")
    if a.plot:
        plot(results, Path(a.plot))
    return 0


def plot(results: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, s in results.items():
        ys = s["per_position_acceptance"]
        ax.plot([j + 1 for j, y in enumerate(ys) if y is not None], [y for y in ys if y is not None], "o-", label=k)
    ax.set_xlabel("draft position (given the earlier ones were accepted)")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "per_position_acceptance.png", dpi=120)
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "k:", lw=1)
    for k, s in results.items():
        cal = s["calibration"]
        if len(cal) > 1:
            ax.plot([c["confidence"] for c in cal], [c["accepted"] for c in cal], "o-", label=k)
    ax.set_xlabel("draft confidence (bin mean)")
    ax.set_ylabel("measured acceptance")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "calibration.png", dpi=120)
    print(f"wrote {out}/per_position_acceptance.png, {out}/calibration.png")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
