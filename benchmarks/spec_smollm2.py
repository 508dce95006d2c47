"""Speculative decoding on SmolLM2-135M (bf16) with its layer-skip draft: the figures issue B asks for.

    .venv/bin/python benchmarks/spec_smollm2.py [--prompts 12 --tokens 48]

1. Greedy first divergence: speculative (layer-skip, gamma 4, compact and padded) vs target-only greedy. In bf16 a
   multi-row verify and a one-row decode round differently, so a near-tie can flip; for every divergence we print the
   target's logit margin between the two tokens at that position (a bug would show large margins).
2. Acceptance, teacher-forced on the target's own greedy continuations: rejection = E[sum_v min(p, q)], coupled =
   P(argmax(log p + G) == argmax(log q + G)) over 512 Gumbel draws per position, at T = 0.7 and 1.0.
3. End to end: tokens/s of target-only, n-gram and layer-skip drafting on the same prompts, in one run.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec.draft import make_drafter
from specdec.draft.model import layer_skip
from specdec.engine.engine import Engine
from specdec.engine.registry import load
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.sampling import SamplingParams, probs

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain what a hash table is in two sentences.",
    "Give three tips for writing clear documentation.",
    "What causes the seasons on Earth?",
    "Write a haiku about the ocean.",
    "Summarise the plot of Romeo and Juliet.",
    "How do I sort a list of dictionaries by a key in Python?",
    "List the planets of the solar system in order.",
    "What is the difference between TCP and UDP?",
    "Write a short email declining a meeting invitation.",
    "Explain recursion to a ten-year-old.",
    "What are the benefits of unit testing?",
    "Describe how a bicycle works.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a SQL query that counts orders per customer.",
    "Why is the sky blue?",
]


def logits_all(model, ids):
    return Engine(model, kv_tokens=4096).score(ids)


def divergence(lm, prompts, tokens):
    skip = make_drafter("layer-skip", lm.model, skip="0-11,18-29")
    ref = SpeculativeGenerator(Engine(lm.model), None).generate(
        [GenRequest(p, SamplingParams(), tokens) for p in prompts])
    res = {}
    for layout in ("compact", "padded"):
        outs = SpeculativeGenerator(Engine(lm.model), skip, gamma=4, layout=layout).generate(
            [GenRequest(p, SamplingParams(), tokens) for p in prompts])
        firsts, margins = [], []
        for p, o, r in zip(prompts, outs, ref):
            k = next((i for i, (a, b) in enumerate(zip(o.tokens, r.tokens)) if a != b), None)
            if k is None:
                continue
            # margin of the target-only decode's logits at the divergent position, between the two choices
            lg = logits_all(lm.model, p + r.tokens[:k])[-1]
            firsts.append(k)
            margins.append(float(lg[r.tokens[k]] - lg[o.tokens[k]]))
        res[layout] = {"prompts": len(prompts), "diverged": len(firsts), "first_divergence_at": firsts,
                       "logit_margins": [round(m, 4) for m in margins]}
    return res, ref


def acceptance(lm, prompts, ref, temps=(0.7, 1.0), draws=512):
    draft = layer_skip(lm.model, "0-11,18-29")
    out = {}
    for T in temps:
        params = SamplingParams(temperature=T)
        rej, cpl = [], []
        for i, (p, r) in enumerate(zip(prompts, ref)):
            ids = p + r.tokens
            P = probs(logits_all(lm.model, ids)[len(p) - 1:-1], params)
            Q = probs(logits_all(draft, ids)[len(p) - 1:-1], params)
            rej.append(torch.minimum(P, Q).sum(-1))
            g = torch.Generator().manual_seed(i)
            for t in range(P.shape[0]):   # shared Gumbel noise, many draws per position
                G = -torch.log(-torch.log(torch.rand(draws, P.shape[1], generator=g, dtype=torch.float64)))
                cpl.append(((P[t].log() + G).argmax(-1) == (Q[t].log() + G).argmax(-1)).double().mean())
        out[f"T={T}"] = {"rejection": float(torch.cat(rej).mean()), "coupled": float(torch.stack(cpl).mean())}
    return out


def speed(lm, prompts, tokens):
    systems = {"target-only": None, "ngram": make_drafter("ngram"),
               "layer-skip": make_drafter("layer-skip", lm.model, skip="0-11,18-29")}
    res = {}
    for name, d in systems.items():
        gen = SpeculativeGenerator(Engine(lm.model), d, gamma=4)
        gen.generate([GenRequest(prompts[0], SamplingParams(), 8)])  # warm-up
        n = steps = acc = drafted = 0
        t0 = time.perf_counter()
        for p in prompts:  # batch 1, one request at a time
            o = gen.generate([GenRequest(p, SamplingParams(), tokens)])[0]
            n += len(o.tokens)
            steps, acc, drafted = steps + o.stats.steps, acc + o.stats.accepted, drafted + o.stats.drafted
        dt = time.perf_counter() - t0
        res[name] = {"tokens_per_s": n / dt, "AL": n / steps, "accepted_over_drafted": acc / drafted if drafted else 0}
    base = res["target-only"]["tokens_per_s"]
    for r in res.values():
        r["speedup"] = r["tokens_per_s"] / base
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default="runs/spec_smollm2.json")
    args = ap.parse_args()
    lm = load("smollm2-135m")
    prompts = [lm.tokenizer.chat([{"role": "user", "content": q}]) for q in PROMPTS[:args.prompts]]
    div, ref = divergence(lm, prompts, args.tokens)
    for layout, d in div.items():
        print(f"greedy first divergence ({layout}): {d['diverged']}/{d['prompts']} prompts diverged within "
              f"{args.tokens} tokens; at {d['first_divergence_at']}; target logit margins {d['logit_margins']}")
    acc = acceptance(lm, prompts[:5], ref[:5])
    for T, a in acc.items():
        print(f"teacher-forced acceptance {T}: rejection {a['rejection']:.3f}, coupled {a['coupled']:.3f} "
              f"({a['coupled'] / a['rejection']:.0%})")
    sp = speed(lm, prompts, args.tokens)
    for name, r in sp.items():
        print(f"{name:>12}: {r['tokens_per_s']:6.1f} tokens/s  speedup {r['speedup']:.2f}x  AL {r['AL']:.2f}  "
              f"accepted/drafted {r['accepted_over_drafted']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"divergence": div, "acceptance": acc, "speed": sp}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
