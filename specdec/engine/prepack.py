"""Dense linears on weights prepacked once for oneDNN, where that gives exactly F.linear's bits.

A bf16 `F.linear` on CPU runs oneDNN's matmul, which reorders the plain [N, K] weight into its blocked layout on every
call: a second pass over every weight in every forward, and a forward of a small model is mostly reading weights.
`prepack_linears` does the reorder once, when an engine is built (`torch.ops.mkldnn._reorder_linear_weight`, the weight
then an opaque mkldnn tensor in the module's place), and `quant.linear` runs such a weight through
`mkldnn._linear_pointwise`. Measured on a 2-core AVX-512-bf16 EPYC, SmolLM2 bf16: a decode step 39.5 -> 24.5 ms, a
verify of 8 x 3 rows 72.5 -> 52.8 ms, logits bitwise equal. The prepacked copy replaces the plain weight, which is
freed (the loader copies weights out of the file's mapping, loader.load_hf_dir, so nothing keeps their pages).

The engine's determinism rests on the linears' bits (batch invariance, row_tiles.py), so a weight is packed only
where, for random rows, the packed product equals F.linear bitwise at every row count PROBE_COUNTS tries up to the
most rows it will be called with (once per shape, bias, dtype and thread count: what the kernel choice depends on);
elsewhere it stays as it is. A batch-invariant engine calls its linears on at most its row window's `hi` rows, so it
asks for agreement up to BOUNDED_ROWS and keeps its window within the rows that agreed (`rows_limit`): on a 2-core
Sapphire Rapids Xeon (AMX) oneDNN's packed and plain bf16 products part at 33 rows, where the plain one changes
kernel too (its window is 1..32), and packing there took a SmolLM2 decode from 27.3 to 20.9 ms, a 16-row verify
from 34.1 to 28.7. Other engines call with any number of rows and need every count. The engine's outputs are then
those of the unpacked model. A tied embedding stays plain: the lookup needs its rows, and a packed
copy for the output GEMM costs the embedding's size again (SmolLM2: 57 MB for 0.5-1 ms of a 13-19 ms forward on a
Zen 5 EPYC, 1 of 31 ms on a Zen 4; Qwen 1.5B: 467 MB). Only bf16 weights on
CPU are packed (the case measured; float32 and fp16 linears go through other GEMMs). `row_tiles.tile_linears` packs
the nn.Linears of modules that call them directly (the block drafter's: 8 requests' 4-slot draft 6.2 -> 5.1 ms, one
request 2.4 -> 1.7 ms, on a Zen 5 EPYC) as the engine packs its own.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

PROBE_COUNTS = (1, 2, 3, 8, 17, 32, 33, 65, 130)
BOUNDED_ROWS = 32                   # a batch-invariant engine's linears: agreement up to here is enough to pack
UNBOUNDED = 1 << 30
_agrees: dict[tuple, int] = {}      # (shape, has bias, dtype, threads) -> the most rows packed == F.linear, bitwise


@functools.cache
def available() -> bool:
    """oneDNN's bf16 reorder exists in this build and runs on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT:
    on an AVX2-only Zen 3 EPYC it raises, and every bf16 linear stays plain there)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def is_prepacked(w) -> bool:
    return isinstance(w, torch.Tensor) and w.is_mkldnn


def prepacked_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


def dense(w: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a weight, packed or not (to_dense gives the original bits back)."""
    return w.to_dense() if is_prepacked(w) else w


def _packable(w) -> bool:
    return (isinstance(w, torch.Tensor) and not is_prepacked(w) and w.dtype == torch.bfloat16
            and w.device.type == "cpu" and w.dim() == 2)


def _rows_agreeing(w: torch.Tensor, b: torch.Tensor | None) -> int:
    """The largest count of PROBE_COUNTS up to which the packed product equals F.linear at every count tried (0: not
    even one row; UNBOUNDED: all of them)."""
    key = (tuple(w.shape), b is not None, w.dtype, torch.get_num_threads())
    if key not in _agrees:
        gen = torch.Generator().manual_seed(0)
        wr = torch.randn(w.shape, generator=gen, dtype=w.dtype)     # drawn in bf16: no float32 vocab x dim copy
        br = None if b is None else torch.randn(b.shape, generator=gen, dtype=b.dtype)
        p = torch.ops.mkldnn._reorder_linear_weight(wr, 1)
        x = torch.randn(max(PROBE_COUNTS), w.shape[1], generator=gen, dtype=w.dtype)
        agreed = UNBOUNDED
        with torch.inference_mode():
            for i, n in enumerate(PROBE_COUNTS):
                if not torch.equal(prepacked_linear(x[:n], p, br), torch.nn.functional.linear(x[:n], wr, br)):
                    agreed = PROBE_COUNTS[i - 1] if i else 0
                    break
        _agrees[key] = agreed
    return _agrees[key]


def _keeps_bits(w: torch.Tensor, b: torch.Tensor | None, rows: int = UNBOUNDED) -> bool:
    """May this linear's weight be packed: a bf16 CPU matrix (bias of its dtype) whose packed product is F.linear's
    on calls of up to `rows` rows."""
    return _packable(w) and (b is None or b.dtype == w.dtype) and _rows_agreeing(w, b) >= rows


def rows_limit(w) -> int:
    """The most rows a call may have and keep F.linear's bits: a packed weight's agreed rows, else UNBOUNDED."""
    return getattr(w, "rows_agreed", UNBOUNDED) if is_prepacked(w) else UNBOUNDED


def _packed(w: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1), requires_grad=False)


def pack(w, b: torch.Tensor | None = None, rows: int = UNBOUNDED):
    """w prepacked where that keeps F.linear's bits on calls of up to `rows` rows (a Parameter; `rows_limit` reads how
    far it agreed), else w itself."""
    if not (available() and _keeps_bits(w, b, rows)):
        return w
    packed = _packed(w)
    packed.rows_agreed = _rows_agreeing(w, b)
    return packed


def prepack_linears(model, rows: int = UNBOUNDED) -> int:
    """Pack the block linears and an untied lm_head of `model` in place where it keeps F.linear's bits on calls of up
    to `rows` rows (the packed weight's `rows_limit` then says how far it agreed); idempotent (an engine built again on
    the same model, e.g. a draft's feature engine, finds them packed). Returns how many."""
    n = 0
    for m in model.linears().values():
        if m is None:                     # a tied head: the embedding, which stays plain
            continue
        w = pack(m.weight, getattr(m, "bias", None), rows)
        if w is not m.weight:             # assigned only when packed (a QLinear's `weight` is the QLinear itself)
            m.weight = w
            n += 1
    return n


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict with packed weights given back as plain tensors (export, checkpoints, peers built from ours)."""
    return {k: dense(v) for k, v in model.state_dict().items()}
