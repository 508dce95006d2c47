"""`specdec` command line. Errors from bad input print one clear line (exit 2), never a traceback."""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from .engine.registry import DEFAULT_MODEL, PRESETS
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset ({', '.join(PRESETS)}), .gguf file or HF dir")
    p.add_argument("--dtype", default=None, help="bf16 (default for real models) | fp32 | fp64 (default for tiny-*)")
    p.add_argument("--kv-tokens", type=int, default=16384, help="KV pool size in tokens")
    add_quant_arg(p)
    add_device_args(p)
    add_batch_invariant_arg(p)


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=int(os.environ.get("SPECDEC_TP", 1)),
                   help="tensor-parallel ranks for the target (this process is rank 0) [SPECDEC_TP]")
    p.add_argument("--device", default=os.environ.get("SPECDEC_DEVICE", "cpu"),
                   help="cpu | cuda | cuda:N (with --tp, rank r on cuda:N+r; a model drafter on cuda:N) "
                        "[SPECDEC_DEVICE]")


def add_quant_arg(p: argparse.ArgumentParser, flag: str = "--quant", env: str = "SPECDEC_QUANT",
                  what: str = "the target") -> None:
    # choices= makes argparse name the flag and the allowed values; an env value is checked by registry.load.
    from .engine.quant import MODES as QUANT_MODES
    p.add_argument(flag, default=os.environ.get(env, "none"), choices=QUANT_MODES,
                   help=f"quantized linears for {what}: weight-only int8 per channel or int4 groups of 32; w8a8 / "
                        f"w4a8: 8- / 4-bit weights times int8 activations (our kernel); 4-bit from a GGUF's own "
                        f"blocks where it has them; cached like the converted weights [{env}]")


def _model_drafter_arg(p: argparse.ArgumentParser, flag: str, env: str, kind: type, help: str, several: bool) -> None:
    """A model drafter's option; several=True (specdec bench): a comma-separated list, each model drafter run once
    per value (bench splits it)."""
    default = os.environ.get(env, "0")
    p.add_argument(flag, type=str if several else kind, default=default if several else kind(default),
                   help=help + ("; several, comma-separated, run each model drafter once per value" if several
                                else "") + f" [{env}]")


def add_draft_vocab_arg(p: argparse.ArgumentParser, several: bool = False) -> None:
    _model_drafter_arg(p, "--draft-vocab", "SPECDEC_DRAFT_VOCAB", int,
                       "a draft model drafts from token ids below this only: a head that many rows long (BPE ids run "
                       "in merge order, frequent first); exact in every acceptance mode; 0 = the whole vocabulary",
                       several)


def add_draft_min_conf_arg(p: argparse.ArgumentParser, several: bool = False) -> None:
    _model_drafter_arg(p, "--draft-min-conf", "SPECDEC_DRAFT_MIN_CONF", float,
                       "a draft model ends a greedy or coupled request's block at the first token it drafts with "
                       "less than this probability (each slot costs a draft forward); outputs never change; 0 = "
                       "always the whole block", several)


def add_batch_invariant_arg(p: argparse.ArgumentParser) -> None:
    v = os.environ.get("SPECDEC_BATCH_INVARIANT", "").strip().lower()
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   default=not v or v not in ("0", "false", "no", "off"),
                   help="engines (target and model drafter) compute each row independently of the rest of the "
                        "forward: exact replay whatever the batch (default on; off: a little faster) "
                        "[SPECDEC_BATCH_INVARIANT]")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="seed for non-greedy sampling (chosen and printed if unset)")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default=None, help="ngram | corpus | layer-skip | block | a draft model (preset/path), "
                                                 "each optionally +ngram and/or +corpus (lookups tried first); "
                                                 "unset = target-only decoding")
    p.add_argument("--draft-layers", default=None, help="layer-skip: target layers to keep, e.g. 0-11,18-29")
    add_quant_arg(p, "--draft-quant", "SPECDEC_DRAFT_QUANT", "a draft model (layer-skip shares the target's)")
    add_draft_vocab_arg(p)
    add_draft_min_conf_arg(p)
    p.add_argument("--draft-checkpoint", default=None, help="block: a trained drafter's directory (default: the one "
                   "shipped for the target; make train-drafter writes ~/.cache/specdec/drafter/...)")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per block")
    p.add_argument("--acceptance", default="coupled", choices=["rejection", "coupled"],
                   help="for non-greedy requests (greedy requests always accept greedily): coupled gives exactly "
                        "plain seeded decoding's text; rejection accepts a few %% more drafts but its text depends "
                        "on the proposals")
    p.add_argument("--verify", default="compact", choices=["compact", "padded"], help="verify layout")
    p.add_argument("--tree-rows", type=int, default=None, help="verify-tree leaf rows a step may add beside the "
                   "chain (alternatives to the first draft slots; 0: chains only; default: speculative/tree.py's)")
    p.add_argument("--trace", default=None, help="write a JSONL trace (one record per request per verify step)")


def cmd_generate(args) -> int:
    import torch

    from .engine.backend import open_backend

    torch.set_num_threads(int(os.environ.get("SPECDEC_THREADS", torch.get_num_threads())))
    lm = open_backend(args.model, tp=args.tp, dtype=args.dtype, device=args.device, kv_tokens=args.kv_tokens,
                      batch_invariant=args.batch_invariant, quant=args.quant)
    try:
        return _generate(args, lm)
    finally:
        lm.backend.close()


def _generate(args, lm) -> int:
    from .engine.tokenizer import StreamDecoder
    from .speculative.generator import GenRequest, SpeculativeGenerator
    from .speculative.tree import TREE_ROWS
    from .speculative.sampling import SamplingParams

    engine = lm.backend
    drafter = None
    if args.draft:
        from .draft import make_drafter
        target = lm.model
        if target is None and args.draft in ("layer-skip", "block"):   # under TP no process holds the whole target
            from .engine.registry import load
            target = load(args.model, args.dtype, quant=args.quant).model
        drafter = make_drafter(args.draft, target, dtype=args.dtype, kv_tokens=args.kv_tokens,
                               skip=args.draft_layers, batch_invariant=args.batch_invariant, device=args.device,
                               checkpoint=args.draft_checkpoint, quant=args.draft_quant, vocab=args.draft_vocab,
                               min_conf=args.draft_min_conf)
    tok = lm.tokenizer
    prompt = tok.chat([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed)
    stream = StreamDecoder(tok)
    first: list[float] = []

    def on_tokens(_, toks):
        first or first.append(time.perf_counter())
        sys.stdout.write(stream.push(toks))
        sys.stdout.flush()

    tp = f", TP{args.tp}" if args.tp > 1 else ""
    tp += f", {args.quant}" if args.quant != "none" else ""
    print(f"[{lm.name}: {lm.cfg.arch}, {lm.cfg.n_layers} layers, {engine.dtype}{tp}, loaded in {lm.load_seconds:.1f}s"
          + (f"; draft {args.draft}, gamma {args.gamma}, {args.verify} verify" if drafter else "; target-only") + "]",
          file=sys.stderr)
    trace = open(args.trace, "w") if args.trace else None
    try:
        # No drafter: every step verifies the anchor alone, which is plain decoding.
        gen = SpeculativeGenerator(engine, drafter, gamma=args.gamma, mode=args.acceptance, layout=args.verify,
                                   tokenizer=tok, trace=trace,
                                   tree_rows=TREE_ROWS if args.tree_rows is None else args.tree_rows)
        t0 = time.perf_counter()
        out = gen.generate([GenRequest(prompt, params, args.max_tokens, tok.eos_ids)], on_tokens)[0]
        t1 = time.perf_counter()
    finally:
        if trace:
            trace.close()
    n, s = len(out.tokens), out.stats
    seed = f", seed {out.seed}" if out.seed is not None else ""
    spec = (f" AL {out.tokens_per_step:.2f} tokens/step, AR {s.acceptance_rate:.2f} ({s.accepted}/{s.drafted}),"
            if drafter else "")
    print(f"\n[{n} tokens in {t1 - t0:.2f}s: {n / (t1 - t0):.1f} tokens/s,{spec} {s.steps} steps, "
          f"prompt {len(prompt)} tokens, finish {out.finish_reason}{seed}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .compute import keep_freed_memory
    from .errors import SpecdecError
    keep_freed_memory()

    ap = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text, speculatively with --draft")
    _add_model_args(g)
    _add_sampling_args(g)
    _add_spec_args(g)
    g.set_defaults(func=cmd_generate)
    from .bench.main import add_parsers
    add_parsers(sub)
    from .export import add_parser as add_export_parser
    add_export_parser(sub)
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
