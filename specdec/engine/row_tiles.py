"""Row-invariant linears: the row counts at which a GEMM gives each row the same bits, found at start-up.

A batch-invariant engine needs a row's linear output to be the same whether the row is decoded alone, verified with
its block, or packed with other sequences. BLAS libraries switch kernels by row count, and their kernels round
differently. Measured on an AVX-512-bf16 EPYC with 2 threads: bf16 `F.linear` gives a row the same bits at every
count from 2 to 64 rows, but a 1-row call (a GEMV) rounds some rows differently (a few percent of rows, depending on
the data), and with 1 thread the kernel changes again above 16 rows. The packed int4/int8 kernels compute row by row.

So the engine asks `probe_row_tiles` for a window [lo, hi] of row counts over which the backend is consistent, and
`RowTiles` runs every linear on calls of lo..hi rows: fewer rows are zero-padded up to lo, more are split into calls
of hi. On the machine above that is (2, 64): a decode pays a 2-row GEMM (about the cost of one row) instead of the
16-row tile this replaced. The probe uses random rows, so it is evidence rather than proof; the engine tests check
whole forwards bitwise.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from . import kernels, prepack
from .quant import BITS, QLinear, linear

PROBE_ROWS = 64
UNBOUNDED = 1 << 30   # hi of a kernel that computes each row on its own by construction: no call is split
CANDIDATES = ((1, 64), (2, 64), (1, 32), (2, 32), (1, 16), (2, 16), (4, 16), (8, 16), (16, 16))
_probed: dict[tuple, tuple[int, int] | None] = {}   # (weight shape/kind, dtype, device, threads) -> window


@dataclasses.dataclass(frozen=True)
class RowTiles:
    """Run `linear` on calls of lo..hi rows only (see the module docstring). A function of (x, w, b) like F.linear."""
    lo: int
    hi: int

    def __call__(self, x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
        T = x.shape[0]
        if self.lo <= T <= self.hi:
            return linear(x, w, b)
        if T < self.lo:
            xp = x.new_zeros(self.lo, x.shape[1])
            xp[:T] = x
            return linear(xp, w, b)[:T]
        return torch.cat([self(x[i:i + self.hi], w, b) for i in range(0, T, self.hi)])


def _key(w) -> tuple:
    kind = w.kind if isinstance(w, QLinear) else "dense"
    return tuple(w.shape), kind, w.dtype, str(w.device), torch.get_num_threads()


def _window(w, trials: int = 2, max_hi: int = UNBOUNDED) -> tuple[int, int] | None:
    """The first candidate window [lo, hi] (hi at most max_hi) in which, for `trials` random inputs, every row gets
    the bits of the hi-row call: each row alone (padded to lo; a GEMV's rounding shows only on some rows, so all are
    tried) and the first n rows in one call, for every n up to hi."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(PROBE_ROWS, w.shape[1], generator=gen).to(w.dtype).to(w.device) for _ in range(trials)]
    memo: dict[tuple, torch.Tensor] = {}

    def call(t: int, i: int, n: int, lo: int) -> torch.Tensor:     # rows i..i+n of input t through RowTiles(lo, n)
        if (t, i, n, lo) not in memo:
            memo[t, i, n, lo] = RowTiles(lo, max(n, lo))(xs[t][i:i + n], w)
        return memo[t, i, n, lo]

    for lo, hi in CANDIDATES:
        if hi > max_hi:
            continue
        if all(torch.equal(call(t, i, 1, lo), call(t, 0, hi, lo)[i:i + 1]) for t in range(trials) for i in range(hi)) \
                and all(torch.equal(call(t, 0, n, lo), call(t, 0, hi, lo)[:n])
                        for t in range(trials) for n in range(2, hi)):
            if (lo, hi) == (1, PROBE_ROWS) and (isinstance(w, QLinear) and w.kind in BITS
                                                or kernels.bf16_linear_usable(xs[0], w, None)):
                # our qdot and bf16_linear compute a row's outputs from that row alone whatever the count
                # (tests/test_quant.py, test_layer_ops.py): splitting a 140-token prefill into calls of 64 rows and
                # joining them cost it ~4%
                return 1, UNBOUNDED
            return lo, hi
    return None


def probe_row_tiles(weights, max_hi: int = UNBOUNDED) -> RowTiles:
    """The widest window every weight agrees on, calls of at most max_hi rows and of no more rows than a prepacked
    weight agreed with F.linear on (prepack.rows_limit) (cached per weight shape and kind, dtype, device and thread
    count, which is what a BLAS picks its kernels by, and max_hi). Falls back to 16-row tiles: one call shape for
    every row."""
    weights = list(weights)
    max_hi = min([max_hi] + [prepack.rows_limit(w) for w in weights])
    los, his = [], []
    for w in weights:
        key = (*_key(w), max_hi)
        if key not in _probed:
            with torch.inference_mode():      # as a forward runs: the layer kernels are not taken under autograd
                _probed[key] = _window(w, max_hi=max_hi)
        if _probed[key] is None:
            return RowTiles(16, 16)
        los.append(_probed[key][0])
        his.append(_probed[key][1])
    lo, hi = max(los), min(his)
    return RowTiles(lo, hi) if lo <= hi else RowTiles(16, 16)


class TiledLinear(nn.Module):
    """An nn.Linear run as the engine runs its own linears (x with any leading dims): through `linear` (a prepacked
    weight, or bf16_linear where bf16 is emulated) on calls of `tiles`' rows only. For modules that call their linears
    themselves (the block drafter's): a row's output then never depends on the rows beside it."""

    def __init__(self, m: nn.Linear, weight, tiles: RowTiles):
        super().__init__()
        self.in_features, self.out_features = m.in_features, m.out_features
        self.weight, self.bias, self.tiles = weight, m.bias, tiles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tiles(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def tile_linears(module: nn.Module) -> RowTiles | None:
    """Replace every nn.Linear inside `module` by a TiledLinear, for inference (a packed weight has no gradient): each
    weight prepacked where that keeps F.linear's bits within a bounded row window (prepack.py), and one RowTiles
    window for all of them, as a batch-invariant engine builds its own. Returns the window (None: no linears)."""
    lins = [(parent, name, m) for parent in module.modules() for name, m in parent.named_children()
            if type(m) is nn.Linear]
    if not lins:
        return None
    weights = [prepack.pack(m.weight, m.bias, prepack.BOUNDED_ROWS) for _, _, m in lins]
    tiles = probe_row_tiles(weights)
    for (parent, name, m), w in zip(lins, weights):
        setattr(parent, name, TiledLinear(m, w, tiles))
    return tiles
