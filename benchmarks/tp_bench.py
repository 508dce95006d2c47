"""TP1 vs TPN on this machine: decode and verify forward time, bytes moved by collectives per forward, and how much of
rank 0's forward is spent in collectives (waits for the other ranks included). A benchmark, not a test.

    .venv/bin/python benchmarks/tp_bench.py --model smollm2-135m --tp 1,2 --prompt 256 --reps 20
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.engine.backend import open_backend
from specdec.engine.layout import SeqInput


def measure(backend, prompt_len: int, reps: int, shapes: list[tuple[int, int]]) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for batch, rows in shapes:
        seqs = [backend.new_sequence() for _ in range(batch)]
        for s in seqs:
            backend.forward([SeqInput(s, torch.randint(0, 1000, (prompt_len,), generator=g).tolist(), logits="none")])
        times, wire, comm = [], [], []
        for i in range(reps + 2):                          # 2 warm-up forwards
            w0, c0 = getattr(backend, "wire_bytes", 0), getattr(backend, "comm_seconds", 0.0)
            t0 = time.perf_counter()
            backend.forward([SeqInput(s, list(range(100, 100 + rows)), start=prompt_len, logits="all") for s in seqs])
            dt = time.perf_counter() - t0
            for s in seqs:
                backend.truncate(s, prompt_len)            # rollback: every rep scores the same rows
            if i >= 2:
                times.append(dt)
                wire.append(getattr(backend, "wire_bytes", 0) - w0)
                comm.append(getattr(backend, "comm_seconds", 0.0) - c0)
        for s in seqs:
            backend.release(s)
        out[f"{batch}x{rows}"] = dict(ms=1e3 * statistics.median(times), wire_kb=statistics.median(wire) / 1024,
                                      comm_ms=1e3 * statistics.median(comm))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="1x1,1x5,8x1,8x5", help="BATCHxROWS: 1 row = decode, 5 rows = verify gamma 4")
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    res = {}
    for n in (int(x) for x in a.tp.split(",")):
        lm = open_backend(a.model, tp=n, kv_tokens=16 * (a.prompt + 32))
        try:
            res[n] = measure(lm.backend, a.prompt, a.reps, shapes)
        finally:
            lm.backend.close()
    print(f"{a.model}, prompt {a.prompt}, median of {a.reps}; torch threads per rank = cores / N")
    print(f"{'shape':>6} " + " ".join(f"{'TP' + str(n) + ' ms':>9} {'comm ms':>8} {'wire KiB':>9}" for n in res))
    for sh in res[next(iter(res))]:
        print(f"{sh:>6} " + " ".join(f"{res[n][sh]['ms']:9.1f} {res[n][sh]['comm_ms']:8.1f} {res[n][sh]['wire_kb']:9.1f}"
                                      for n in res))


if __name__ == "__main__":
    main()
