"""Kernel table (not a test): ms per call of bf16 F.linear, the int8 and int4 packed kernels, and a
dequantise-then-GEMM variant, for 1..16 rows on the linears of a model, so the per-tier choice is measured here.

    .venv/bin/python benchmarks/quant_kernels.py --shapes 8960x1536,1536x8960,3072x576 --rows 1,2,4,8,16
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from engine_bench import timed  # benchmarks/ is on sys.path when this file runs as a script
from specdec.engine import quant as Q


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8960x1536,1536x8960,2048x1536,3072x576,576x1536,49152x576")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    print(f"threads {a.threads}, torch {torch.__version__}")
    print(f"{'shape':>12} {'rows':>4} {'bf16':>7} {'int8':>7} {'int4':>7} {'int4-deq+bf16':>13}")
    for s in a.shapes.split(","):
        N, K = (int(x) for x in s.split("x"))
        w = torch.randn(N, K) * 0.02
        wb = w.bfloat16()
        l8 = Q.QLinear.int8(*Q.quantize_int8(w))
        l4 = Q.QLinear.int4(*Q.quantize_int4(w))
        eye = torch.eye(K, dtype=torch.bfloat16)
        for r in rows:
            x = torch.randn(r, K).bfloat16()
            with torch.inference_mode():
                t = [timed(lambda: F.linear(x, wb), a.reps, warmup=3), timed(lambda: l8.mm(x), a.reps, warmup=3),
                     timed(lambda: l4.mm(x), a.reps, warmup=3),
                     # dequantise the whole weight through the kernel (K one-hot rows), then one bf16 GEMM
                     timed(lambda: F.linear(x, l4.mm(eye).t()), max(3, a.reps // 10), warmup=3)]
            print(f"{s:>12} {r:>4} " + " ".join(f"{v:7.3f}" for v in t[:3]) + f" {t[3]:13.3f}", flush=True)


if __name__ == "__main__":
    main()
