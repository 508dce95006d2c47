"""Engine benchmark (not a test): decode ms/token and verify cost for 1..16 new rows on a cached prefix, for this
engine and for transformers' own forward on the same weights, as ratios from one interleaved run.

    make bench-engine                         # SmolLM2, bf16
    .venv/bin/python benchmarks/engine_bench.py --model qwen2.5-coder-1.5b --rounds 3

Peers: transformers on a dense copy of exactly our dequantised weights (same dtype), and transformers loading the
GGUF itself (its own dequantisation path). Timings alternate engine / peer in rounds so machine noise hits both.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.loader import save_hf_dir
from specdec.engine.registry import GGUF_PRESETS, load, parse_dtype


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def timed(fn, reps, warmup: int = 0):
    """Median ms of `reps` calls (after `warmup` untimed ones)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


class Ours:
    name = "specdec"

    def __init__(self, model, prompt):
        self.e = Engine(model, kv_tokens=4096)
        self.s = self.e.new_sequence()
        self.e.forward([SeqInput(self.s, prompt, logits="none")])
        self.n = len(prompt)

    def step(self, k):
        """k new rows on the cached prefix (1 = decode, k > 1 = verify), then roll back."""
        self.e.forward([SeqInput(self.s, list(range(100, 100 + k)), start=self.n, logits="all" if k > 1 else "last")])
        self.e.truncate(self.s, self.n)


class HF:
    def __init__(self, name, model, prompt):
        from transformers import DynamicCache
        self.name, self.m, self.n = name, model, len(prompt)
        self.cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(torch.tensor([prompt]), past_key_values=self.cache, use_cache=True)

    @torch.inference_mode()
    def step(self, k):
        ids = torch.arange(100, 100 + k)[None]
        self.m(ids, past_key_values=self.cache, use_cache=True, logits_to_keep=0 if k > 1 else 1)
        self.cache.crop(-k)  # transformers 5: a negative count removes that many tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prefix", type=int, default=128, help="cached prompt tokens before each step")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="alternations engine/peer")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-gguf-peer", action="store_true", help="skip transformers' own GGUF loading")
    ap.add_argument("--out", default="runs/bench_engine.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype, torch.bfloat16)
    rows = [int(r) for r in args.rows.split(",")]

    rss0 = rss_mb()
    lm = load(args.model, dtype)
    prompt = (lm.tokenizer.encode("The history of speculative decoding begins with a simple idea. ") * 64)[:args.prefix]
    ours = Ours(lm.model, prompt)
    ours.step(1)
    rss_engine = rss_mb()
    print(f"loaded {args.model} ({dtype}) in {lm.load_seconds:.2f}s; RSS {rss_engine:.0f} MB "
          f"(process before load {rss0:.0f} MB)", file=sys.stderr)

    from transformers import AutoModelForCausalLM
    systems = [ours]
    with tempfile.TemporaryDirectory() as d:
        save_hf_dir(lm.model, d)
        dense = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
    systems.append(HF("transformers (same dense weights)", dense, prompt))
    if not args.no_gguf_peer and args.model in GGUF_PRESETS:
        path = GGUF_PRESETS[args.model]()
        g_dtype = torch.float32  # transformers' recommended (fastest) dtype for GGUF checkpoints
        gg = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=g_dtype).eval()
        systems.append(HF(f"transformers (GGUF load, {g_dtype})", gg, prompt))
    for s in systems:
        s.step(1)

    times = {s.name: {k: [] for k in rows} for s in systems}
    for r in range(args.rounds):
        for k in rows:
            for s in systems:
                times[s.name][k].append(timed(lambda: s.step(k), args.reps))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    ms = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}

    base = ms[ours.name]
    print(f"\n{args.model} {dtype}, prefix {args.prefix}, {args.threads} threads, median of {args.reps} x "
          f"{args.rounds} rounds (ms per forward)")
    print(f"{'rows':>5} " + " ".join(f"{n[:34]:>36}" for n in ms))
    for k in rows:
        print(f"{k:>5} " + " ".join(f"{ms[n][k]:>28.2f} ({ms[n][k] / base[k]:4.2f}x)" for n in ms))
    result = {
        "model": args.model, "dtype": str(dtype), "prefix": args.prefix, "threads": args.threads,
        "load_seconds": lm.load_seconds, "rss_mb_engine": rss_engine, "ms": ms,
        "engine_over_peer_decode": {n: base[1] / ms[n][1] for n in ms if n != ours.name},
        "verify_over_decode": {n: {k: ms[n][k] / ms[n][1] for k in rows} for n in ms},
    }
    print("\nengine / transformers decode ms ratio (goal <= 1.0): " +
          ", ".join(f"{n}: {v:.2f}" for n, v in result["engine_over_peer_decode"].items()))
    if 8 in rows:
        print(f"engine verify-of-8 / decode-of-1 (goal <= 1.3): {base[8] / base[1]:.2f}")
    print(f"engine RSS {rss_engine:.0f} MB (goal <= 1024), load {lm.load_seconds:.2f}s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
