"""Quantized execution vs bf16 vs llama.cpp on the same GGUF (not a test; issue 10's table).

    .venv/bin/python benchmarks/quant_bench.py --model smollm2-135m --rounds 3
    .venv/bin/python benchmarks/quant_bench.py --model qwen2.5-coder-1.5b --modes none,int4 --no-llamacpp
    .venv/bin/python benchmarks/quant_bench.py --model qwen2.5-coder-1.5b --modes w4a8 --rows 1,5 --paired 100

Per engine: decode ms/token and verify ms for k new rows on a cached 128-token prefix (rolled back after each),
128-token prefill tokens/s; rounds alternate engines so machine noise hits all alike. Quality: top-1 agreement and
KL(bf16 || quantized) of next-token distributions over every position of a few prompts. --profile: where a decode
step's milliseconds go (torch.profiler, per op). llama.cpp (if `make peers` installed it) runs the same file.
"""
from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from engine_bench import timed  # benchmarks/ is on sys.path when this file runs as a script
from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.registry import load


class Ours:
    def __init__(self, model, prompt):
        self.e = Engine(model, kv_tokens=4096, prefix_cache=False)    # prefill() runs the same prompt: time it cold
        self.s = self.e.new_sequence()
        self.prompt, self.n = prompt, len(prompt)
        self.e.forward([SeqInput(self.s, prompt, logits="none")])

    def rows(self, k):
        self.e.forward([SeqInput(self.s, list(range(100, 100 + k)), start=self.n, logits="all" if k > 1 else "last")])
        self.e.truncate(self.s, self.n)

    def prefill(self):
        s = self.e.new_sequence()
        self.e.forward([SeqInput(s, self.prompt, logits="last")])
        self.e.release(s)


class Llama:
    def __init__(self, path, prompt, threads):
        from llama_cpp import Llama as L
        self.llm = L(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512,
                     logits_all=True, verbose=False)
        self.prompt, self.n = prompt, len(prompt)
        self.llm.reset()
        self.llm.eval(prompt)

    def rows(self, k):
        self.llm.n_tokens = self.n          # eval() drops the KV cache from n_tokens on, so this rolls back
        self.llm.eval(list(range(100, 100 + k)))

    def prefill(self):
        self.llm.reset()
        self.llm.eval(self.prompt)


def quality(ref_model, models, prompts):
    out = {}
    with torch.inference_mode():
        ref = [Engine(ref_model).score(p).float() for p in prompts]
        for name, m in models.items():
            e = Engine(m)
            agree, kl, n = 0, 0.0, 0
            for p, r in zip(prompts, ref):
                q = e.score(p).float()
                lr, lq = r.log_softmax(-1), q.log_softmax(-1)
                agree += int((r.argmax(-1) == q.argmax(-1)).sum())
                kl += float((lr.exp() * (lr - lq)).sum())
                n += r.shape[0]
            out[name] = (agree / n, kl / n)
    return out


RSS_PROBE = """
import sys, torch
from engine_bench import rss_mb
from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.registry import load
lm = load(sys.argv[1], "bf16", quant=sys.argv[2])
e = Engine(lm.model, kv_tokens=4096)
s = e.new_sequence()
e.forward([SeqInput(s, list(range(1, 129)), logits="last")])
e.forward([SeqInput(s, [5], start=128, logits="last")])
print(rss_mb())
"""


def rss_in_fresh_process(model: str, mode: str) -> float:
    """MiB resident after loading (from the weight cache: run once before to build it) and a decode step."""
    import subprocess
    import sys
    from pathlib import Path
    subprocess.run([sys.executable, "-c", RSS_PROBE, model, mode], check=True, capture_output=True,
                   cwd=Path(__file__).parent)        # first run: builds the caches
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, model, mode], check=True, capture_output=True,
                         text=True, cwd=Path(__file__).parent)
    return float(out.stdout.strip().splitlines()[-1])


def paired(engines: dict, rows: list[int], n: int) -> None:
    """Each engine's time for k rows against llama.cpp's in the call next to it, the order alternating."""
    peer = engines.get("llama.cpp")
    if peer is None:
        raise SystemExit("--paired needs the llama.cpp peer (make peers)")
    for k in rows:
        for name, e in engines.items():
            if e is peer:
                continue
            for f in (e.rows, peer.rows):
                f(k)                                                 # warm
            ours, theirs = [], []
            for i in range(n):
                for side, f in ((ours, e.rows), (theirs, peer.rows))[::1 if i % 2 == 0 else -1]:
                    side.append(timed(lambda: f(k), 1))
            r = [x / y for x, y in zip(ours, theirs)]
            q = statistics.quantiles(r, n=4)
            print(f"{k} rows: {name} {statistics.median(ours):.2f} ms, llama.cpp {statistics.median(theirs):.2f} ms; "
                  f"ratio of pairs: median {statistics.median(r):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}), n = {n}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--modes", default="none,int8,int4")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--paired", type=int, default=0, metavar="N",
                    help="only: N calls of each engine alternating one by one, at each of --rows; the median and "
                         "quartiles of each adjacent pair's time ratio to llama.cpp's (a noisy machine's slow "
                         "minutes hit both alike)")
    ap.add_argument("--rss", action="store_true", help="only: resident memory per mode, each in a fresh process "
                                                       "(load from the cache, engine, 128-token prefill, one decode)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    modes, rows = a.modes.split(","), [int(r) for r in a.rows.split(",")]
    if a.rss:
        for m in modes:
            print(f"{a.model} {m}: RSS {rss_in_fresh_process(a.model, m):.0f} MiB")
        return
    lms = {m: load(a.model, "bf16", quant=m) for m in modes}
    tok = lms[modes[0]].tokenizer
    text = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n" * 12)
    prompt = tok.encode(text)[:128]
    engines = {f"ours {m}": Ours(lm.model, prompt) for m, lm in lms.items()}
    if not a.no_llamacpp:
        try:
            from specdec.bench.llamacpp import gguf_path_of
            engines["llama.cpp"] = Llama(gguf_path_of(a.model), prompt, a.threads)
        except ImportError:
            print("llama.cpp: llama-cpp-python not installed (make peers)")
    if a.paired:
        paired(engines, rows, a.paired)
        return
    res = {n: {k: [] for k in [*rows, "prefill"]} for n in engines}
    for _ in range(a.rounds):
        for n, e in engines.items():
            for k in rows:
                e.rows(k)                                            # warm
                res[n][k].append(timed(lambda: e.rows(k), a.reps))
            res[n]["prefill"].append(timed(e.prefill, max(2, a.reps // 4)))
    print(f"{a.model}, {a.threads} threads, prefix {len(prompt)} tokens, torch {torch.__version__}; "
          f"uptime: {open('/proc/loadavg').read().split()[:3]}")
    print(f"{'engine':<12}" + "".join(f"{f'{k} rows ms':>11}" for k in rows) + f"{'decode tok/s':>13}{'prefill tok/s':>14}")
    for n, r in res.items():
        ms = {k: statistics.median(v) for k, v in r.items()}
        print(f"{n:<12}" + "".join(f"{ms[k]:>11.2f}" for k in rows) + f"{1e3 / ms[1]:>13.1f}"
              f"{len(prompt) * 1e3 / ms['prefill']:>14.1f}")
    if "none" in lms and len(lms) > 1:
        V = lms["none"].cfg.vocab_size
        ps = [tok.encode(t) for t in ("The capital of France is Paris. The capital of Italy is",
                                      "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
                                      "Write a haiku about the sea.")]
        q = quality(lms["none"].model, {m: lms[m].model for m in modes if m != "none"}, ps)
        for m, (agree, kl) in q.items():
            print(f"quality {m} vs bf16 ({sum(map(len, ps))} positions, vocab {V}): top-1 agreement {agree:.3f}, "
                  f"mean KL {kl:.4f} nats")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        for n, e in engines.items():
            if not n.startswith("ours"):
                continue
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    e.rows(1)
            print(f"-- {n}: one decode step, per op (10 steps)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
