"""`specdec bench` and `specdec trace summarize`.

    specdec bench --target smollm2-135m --draft ngram --prompts chat -n 16 --max-tokens 64 --gamma 2,4 --plot runs/p
    specdec bench --url http://127.0.0.1:8000 --prompts humaneval -n 32 --concurrency 8      # a running stack
    specdec trace summarize runs/trace.jsonl
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ..speculative.plan import CostPlanner, profile_cost
from ..speculative.sampling import SamplingParams
from .prompts import encode, load_prompts
from .report import RequestRecord, StepRecord, summarize

COLUMNS = [("gamma", "{:>5}"), ("tokens_per_s", "{:>8.1f}"), ("decode_tokens_per_s", "{:>8.1f}"),
           ("speedup", "{:>7.2f}"), ("decode_speedup", "{:>8.2f}"), ("alpha", "{:>6.2f}"), ("alpha_token", "{:>6.2f}"),
           ("AL", "{:>5.2f}"), ("c", "{:>5.2f}"), ("r", "{:>6.3f}"), ("bound", "{:>6.2f}"), ("efficiency", "{:>6.2f}"),
           ("bound_al", "{:>8.2f}"), ("eff_al", "{:>6.2f}"), ("ttft_p50_s", "{:>7.3f}"), ("itl_p50_s", "{:>7.4f}"),
           ("itl_p99_s", "{:>7.4f}")]


def table(rows: list[tuple[str, dict]]) -> str:
    head = f"{'run':<28}" + " ".join(f"{k[:8]:>{len(f.format(0)) if 'f' in f else 5}}" for k, f in COLUMNS)
    lines = [head]
    for name, r in rows:
        cells = []
        for k, f in COLUMNS:
            v = r.get(k)
            w = len(f.format(0))
            cells.append(f.format(v) if isinstance(v, (int, float)) else f"{'-':>{w}}")
        lines.append(f"{name:<28}" + " ".join(cells))
    return "\n".join(lines)


class HFAssisted:
    """transformers' assisted generation on exactly our weights (exported dense), greedy, batch 1: the peer. With no
    draft model, its prompt-lookup decoding (`prompt_lookup_num_tokens=lookup`)."""

    def __init__(self, target_model, draft_model=None, lookup: int = 0):
        import tempfile

        from transformers import AutoModelForCausalLM

        from ..engine.loader import save_hf_dir
        with tempfile.TemporaryDirectory() as d:
            save_hf_dir(target_model, d + "/t")
            dtype = target_model.embed.weight.dtype
            self.t = AutoModelForCausalLM.from_pretrained(d + "/t", dtype=dtype).eval()
            self.a = None
            if draft_model is not None:
                save_hf_dir(draft_model, d + "/d")
                self.a = AutoModelForCausalLM.from_pretrained(d + "/d", dtype=dtype).eval()
        self.extra = {"assistant_model": self.a} if self.a is not None else {"prompt_lookup_num_tokens": lookup}
        self.tokens, self.wall = 0, 0.0

    def run(self, prompts: list[list[int]], max_tokens: int) -> None:
        import torch
        t0 = time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p])
                out = self.t.generate(ids, attention_mask=torch.ones_like(ids), **self.extra,
                                      max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=0)
                self.tokens += out.shape[1] - ids.shape[1]
        self.wall += time.perf_counter() - t0

    def result(self) -> dict:
        return {"kind": "assisted generation" if self.a is not None else
                f"prompt lookup ({self.extra['prompt_lookup_num_tokens']})",
                "tokens": self.tokens, "wall_s": self.wall, "tokens_per_s": self.tokens / self.wall}


def cmd_bench(args) -> int:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    items = load_prompts(args.prompts, args.n)
    gammas = [int(g) for g in str(args.gamma).split(",")]
    results: dict[str, dict] = {}
    peer, llama = None, None
    if args.url:
        from .run import run_rest
        results.update(bench_rest(run_rest, args, items, params, gammas))
    else:
        import torch

        from ..draft import make_drafter, needs_target
        from ..engine.backend import open_backend
        from .run import run_inprocess
        torch.set_num_threads(args.threads or torch.get_num_threads())
        lm = open_backend(args.target, tp=args.tp, dtype=args.dtype, device=args.device, kv_tokens=args.kv_tokens,
                          batch_invariant=args.batch_invariant, quant=args.quant)
        engine = lm.backend
        prompts = [encode(lm.tokenizer, it) for it in items]
        target = lm.model
        # several drafters, compared in one interleaved run; block:DIR names a trained drafter's checkpoint
        kinds = {name: name.partition(":") for name in args.draft.split(",")}
        if target is None and (args.peer_hf or any(needs_target(k) for k, _, _ in kinds.values())):
            # TP: no process holds the target whole
            from ..engine.registry import load
            target = load(args.target, args.dtype, quant=args.quant).model
        # --draft-vocab N,M / --draft-min-conf P,Q: each model drafter once per value (pair of values), in the same
        # interleaved run
        vocabs = [int(v) for v in str(args.draft_vocab).split(",")]
        confs = [float(v) for v in str(args.draft_min_conf).split(",")]
        variants = {name: [(v, mc, (f" vocab={v or 'all'}" if len(vocabs) > 1 else "") +
                            (f" min_conf={mc:g}" if len(confs) > 1 else ""))
                           for v in vocabs for mc in confs]
                    if kind.split("+")[0] not in ("ngram", "corpus", "block")      # no draft model: one variant
                    else [(vocabs[0], confs[0], "")] for name, (kind, _, _) in kinds.items()}
        drafters = {name + label:
                    make_drafter(kind, target, dtype=args.dtype, kv_tokens=args.kv_tokens, skip=args.draft_layers,
                                 batch_invariant=args.batch_invariant, device=args.device, quant=args.draft_quant,
                                 checkpoint=ckpt or args.draft_checkpoint, vocab=v, min_conf=mc)
                    for name, (kind, _, ckpt) in kinds.items() for v, mc, label in variants[name]}
        common = dict(max_tokens=args.max_tokens, concurrency=args.concurrency, params=params,
                      mode=args.acceptance or "coupled",
                      stop_ids=frozenset() if args.ignore_eos else lm.tokenizer.eos_ids)
        layouts = args.verify.split(",")
        for d in drafters.values():   # warm-up
            run_inprocess(engine, d, prompts[:1], gamma=gammas[0], layout=layouts[0], **{**common, "max_tokens": 4})
        cost = profile_cost(engine) if args.planner == "cost" else None   # SPS table, profiled once
        trees = [int(t) for t in str(args.tree_rows).split(",")]
        configs = [("baseline (speculation off)", None, 1, None, "compact", 0)] + [
            (f"{dn} gamma={g}" + (f" {lay}" if len(layouts) > 1 else "") + (f" tree={t}" if t else "") +
             (" +planner" if cost else ""), d, g, CostPlanner(cost) if cost else None, lay, t)
            for dn, d in drafters.items() for g in gammas for lay in layouts for t in trees]
        # Interleaved: each batch of prompts runs under every configuration before the next batch, so drifting
        # machine load (this CPU is shared) hits the baseline and the speculative runs alike.
        acc = {name: ([], [], 0.0) for name, *_ in configs}
        hf = None
        if args.peer_hf:
            from ..draft.model import ModelDrafter
            model_drafters = [d for d in drafters.values() if isinstance(d, ModelDrafter)]
            # with a model drafter: assisted generation with that model; otherwise prompt-lookup decoding
            hf = HFAssisted(target, model_drafters[0].engine.model if model_drafters else None, lookup=gammas[0])
            hf.run(prompts[:1], 4)     # warm-up
            hf.tokens, hf.wall = 0, 0.0
        llamas = {}
        if args.peer_llamacpp:   # same GGUF, same prompt tokens, same token counts (EOS ignored on both sides)
            from .llamacpp import LlamaCpp, gguf_path_of
            if not args.ignore_eos or args.temperature > 0 or args.concurrency != 1:
                raise SystemExit("--peer-llamacpp compares greedy batch-1 runs of equal length: "
                                 "add --ignore-eos, use --temperature 0 and --concurrency 1")
            path = gguf_path_of(args.target)
            threads = args.threads or torch.get_num_threads()
            llamas = {"llama.cpp decode": LlamaCpp(path, threads),
                      f"llama.cpp prompt-lookup {gammas[0]}": LlamaCpp(path, threads, lookup=gammas[0])}
            for p in llamas.values():
                p.run(prompts[:1], 4)     # warm-up
                p.reset_counts()
        C = args.concurrency
        for b in tqdm(range(0, len(prompts), C), desc="batches", leave=False):
            for name, d, g, plan, lay, t in configs:
                recs, steps, wall = run_inprocess(engine, d, prompts[b:b + C], gamma=g, plan=plan, layout=lay,
                                                  tree_rows=t, **common)
                r0, s0, w0 = acc[name]
                acc[name] = (r0 + recs, s0 + steps, w0 + wall)
            if hf:
                hf.run(prompts[b:b + C], args.max_tokens)
            for p in llamas.values():
                p.run(prompts[b:b + C], args.max_tokens)
        base = summarize(*acc[configs[0][0]], gamma=1)
        results[configs[0][0]] = base
        for name, _, g, _, _, _ in configs[1:]:
            results[name] = summarize(*acc[name], g, base)
        if hf:
            peer = hf.result()
            best = max(v.get("tokens_per_s", 0) for k, v in results.items() if "baseline" not in k)
            peer["ours_over_hf"] = best / peer["tokens_per_s"]
        if llamas:
            llama = {k: p.result() for k, p in llamas.items()}
    print(table(list(results.items())))
    if llama:
        for key, what in (("tokens_per_s", "end to end"), ("decode_tokens_per_s", "decode only")):
            if not all(v.get(key) for v in [*results.values(), *llama.values()]):
                continue                          # one-token requests: nothing after the first token
            base_tps = results["baseline (speculation off)"][key]
            best = max(v[key] for v in results.values())
            for k, v in llama.items():
                print(f"{k:<28}{v[key]:>14.1f}   {what}: ours baseline / it = {base_tps / v[key]:.2f}x, "
                      f"ours best / it = {best / v[key]:.2f}x")
    if peer:
        print(f"transformers {peer['kind']}: {peer['tokens_per_s']:.1f} tokens/s; "
              f"specdec best / transformers = {peer['ours_over_hf']:.2f}x")
    out = {"args": {k: v for k, v in vars(args).items() if k != "func"},
           "runs": {k: {f: x for f, x in v.items() if not f.startswith("_")} for k, v in results.items()},
           "hf_assisted": peer, "llamacpp": llama}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    if args.plot:
        from .plot import plots
        for f in plots(results, args.plot):
            print(f"wrote {f}")
    return 0


def bench_rest(run_rest, args, items, params, gammas: list[int]) -> dict[str, dict]:
    """Through a running stack: the prompts in `args.rounds` consecutive parts, each run under every configuration,
    in turn forwards and backwards (baseline, gamma..., then gamma..., baseline: drift in the machine's load over the
    run hits both alike; one part, the baseline always first, moved served ratios by up to 8% between repeats)."""
    configs = [("baseline (speculation off)", None, 1)] + [
        (f"speculative gamma={g}", {"enabled": True, "gamma": g,
                                    **({"acceptance": args.acceptance} if args.acceptance else {})}, g)
        for g in gammas]
    # a part of fewer prompts than --concurrency never holds that many requests at once (-n 128 in 6 parts ran 32
    # "concurrent" requests 21 at a time), so the parts are cut to hold at least that many each
    parts = max(1, min(args.rounds, len(items) // max(1, args.concurrency)))
    if parts < args.rounds:
        print(f"bench: {len(items)} prompts at concurrency {args.concurrency} make {parts} part(s) of at least "
              f"{args.concurrency}, not {args.rounds}: -n {args.rounds * args.concurrency} or more keeps "
              f"--rounds {args.rounds}", file=sys.stderr)
    acc = {name: ([], [], 0.0) for name, _, _ in configs}
    for k in range(parts):
        chunk = items[k * len(items) // parts:(k + 1) * len(items) // parts]
        for name, spec, _ in configs if k % 2 == 0 else configs[::-1]:
            recs, steps, wall = run_rest(args.url, chunk, max_tokens=args.max_tokens, concurrency=args.concurrency,
                                         params=params, speculative=spec,
                                         desc=name + (f" ({k + 1}/{parts})" if parts > 1 else ""))
            r, s, w = acc[name]
            acc[name] = (r + recs, s + steps, w + wall)
    base = summarize(*acc[configs[0][0]], gamma=1)
    return {configs[0][0]: base, **{name: summarize(*acc[name], g, base) for name, _, g in configs[1:]}}


def cmd_trace_summarize(args) -> int:
    """The bench figures from a trace file (one record per request per verify step)."""
    recs = [json.loads(x) for x in Path(args.file).read_text().splitlines() if x.strip()]
    by_req: dict[str, list[dict]] = {}
    for r in recs:
        by_req.setdefault(r["request"], []).append(r)
    reqs = []
    for rs in by_req.values():
        P = max(r["verify_len"] - 1 for r in rs)
        dpp = [sum(r["verify_len"] - 1 > j for r in rs) for j in range(P)]
        app = [sum(r["accepted"] > j for r in rs) for j in range(P)]
        reqs.append(RequestRecord(sum(r["emitted"] for r in rs), len(rs), sum(r["verify_len"] - 1 for r in rs),
                                  sum(r["accepted"] for r in rs), dpp, app))
    by_step: dict[int, dict] = {}
    for r in recs:
        by_step.setdefault(r["step"], r)
    steps = [StepRecord(r["draft_ms"], r["verify_ms"], r.get("accept_ms", 0) + (r.get("commit_ms") or 0),
                        r["layout_rows"], r["batch"]) for r in by_step.values()]
    wall = sum(s.draft_ms + s.verify_ms + s.other_ms for s in steps) / 1e3
    gamma = max((r["verify_len"] - 1 for r in recs), default=1) or 1
    s = summarize(reqs, steps, wall, gamma)
    s["seeded_fraction"] = statistics.mean(r["seeded"] for r in recs) if recs else 0
    s["modes"] = sorted({r["mode"] for r in recs})
    for k in ("requests", "steps", "tokens", "alpha", "alpha_token", "AL", "per_position_acceptance",
              "draft_ms_per_step", "verify_ms_per_step", "other_ms_per_step", "rows_per_step", "modes",
              "seeded_fraction"):
        v = s[k]
        print(f"{k:>26}: {[round(x, 3) if x is not None else None for x in v] if isinstance(v, list) and k.startswith('per') else (round(v, 4) if isinstance(v, float) else v)}")
    return 0


def add_parsers(sub) -> None:
    b = sub.add_parser("bench", help="benchmark speculative decoding against target-only decoding")
    b.add_argument("--url", default=None, help="a running stack's REST base URL; unset = in process")
    b.add_argument("--target", default="smollm2-135m")
    b.add_argument("--draft", default="ngram", help="in process: ngram | corpus | layer-skip | block[:DIR] | a draft "
                   "model, each optionally +ngram (prompt lookup where the context repeats) and/or +corpus (the "
                   "target's own past text: draft/corpus.py); "
                   "comma-separated: each one in the same interleaved run")
    b.add_argument("--draft-checkpoint", default=None, help="block: the trained drafter (default: the shipped one)")
    b.add_argument("--draft-layers", default=None)
    b.add_argument("--dtype", default=None)
    b.add_argument("--kv-tokens", type=int, default=65536)
    from ..cli import (add_batch_invariant_arg, add_device_args, add_draft_min_conf_arg, add_draft_vocab_arg,
                       add_quant_arg)
    add_batch_invariant_arg(b)             # in process only; with --url the server's setting applies
    add_device_args(b)
    add_quant_arg(b)
    add_quant_arg(b, "--draft-quant", "SPECDEC_DRAFT_QUANT", "a draft model (layer-skip shares the target's)")
    add_draft_vocab_arg(b, several=True)
    add_draft_min_conf_arg(b, several=True)
    b.add_argument("--prompts", default="chat", help="humaneval | chat | FILE.jsonl")
    b.add_argument("-n", type=int, default=16, help="prompts (cycles through the set)")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--ignore-eos", action="store_true", help="always generate max-tokens (steadier timing)")
    b.add_argument("--concurrency", type=int, default=1)
    b.add_argument("--rounds", type=int, default=6,
                   help="with --url: the prompts in this many parts, each under every configuration, the order "
                        "reversed every other part (1: the baseline over all prompts, then each gamma). 6: with 2, "
                        "the same served configuration gave 0.86x-1.10x at 16 requests as the VM's speed drifted. "
                        "Fewer where a part would hold fewer prompts than --concurrency")
    b.add_argument("--gamma", default="4", help="one or more, comma-separated")
    b.add_argument("--acceptance", default=None, choices=["rejection", "coupled"],
                   help="unset: coupled in process, the server's default with --url")
    b.add_argument("--verify", default="compact", help="compact | padded | compact,padded (A/B in one run)")
    b.add_argument("--planner", default="off", choices=["off", "cost"])
    b.add_argument("--tree-rows", default="0", help="in process: verify-tree leaf rows a step may add (0: chains "
                   "only); comma-separated values are compared in one run")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--seed", type=int, default=None)
    b.add_argument("--threads", type=int, default=0)
    b.add_argument("--peer-hf", action="store_true", help="also run transformers assisted generation (with the "
                   "model drafter) or, without one, its prompt-lookup decoding (prompt_lookup_num_tokens = gamma)")
    b.add_argument("--peer-llamacpp", action="store_true",
                   help="also run llama.cpp (llama-cpp-python, `make peers`) on the target's GGUF, interleaved: plain "
                        "decoding and its prompt-lookup speculation (needs --ignore-eos, greedy, concurrency 1)")
    b.add_argument("--plot", default=None, help="directory for PNG plots")
    b.add_argument("--out", default="runs/bench.json")
    b.set_defaults(func=cmd_bench)
    t = sub.add_parser("trace", help="trace tools")
    tsub = t.add_subparsers(dest="trace_cmd", required=True)
    s = tsub.add_parser("summarize", help="the bench figures from a JSONL trace")
    s.add_argument("file")
    s.set_defaults(func=cmd_trace_summarize)
