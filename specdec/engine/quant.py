"""Quantized linears. Weight-only: int8 per output channel, int4 in groups of 32 along the input dim (PyTorch's
kernels, activations in the model dtype). With int8 activations: w8a8 / w4a8, 8- or 4-bit weight codes in groups of
32 times activations quantized to int8 per group of 32 on the fly (our kernel, engine/kernels/qdot.cpp).

    model = quantize_model(model, "int4", gguf_path)   # block linears int4, lm_head int8
    logits = linear(x, layer.attn.wqkv.weight, bias)   # the packed kernel for a QLinear, F.linear for a tensor

The matmuls are PyTorch's packed CPU kernels: `_weight_int4pack_mm_for_cpu` (w = (q - 8) * scale + zero per group
of 32, scale/zero in the activation dtype) and `_weight_int8pack_mm` (w = q * scale per row). Both compute each row
of x on its own, so a row's bits do not depend on how many rows share the call: the engine's start-up probe checks
that, as it does for F.linear (engine/row_tiles.py).

Where the weights come from (what is exact and what is requantized):
- int4 from a GGUF's Q4_0 / Q4_1 / Q4_K blocks: the 4-bit codes are taken as they are, and each group of 32 gets
  scale = d (Q4_K: d * sub-block scale) and offset = m (Q4_0: -8d; Q4_K: -dmin * sub-block min), so
  scale * q + offset reproduces the file's dequantised values bitwise in float32 (tests/test_quant.py). The kernel
  holds scale and zero = offset + 8 * scale in bf16, so those two per group are rounded to bf16 (8-bit mantissa):
  the one approximation of this path.
- int4 from anything else (Q5_0, Q6_K, Q8_0, F16/F32 files, HF directories, tiny models): dequantised to float32,
  then requantized per group of 32 with the group's min and max (asymmetric, 16 levels).
- int8 (and the lm_head in int4 mode, which llama.cpp's Q4_K_M also keeps wider): dequantised to float32, then
  requantized per output row, scale = max|w| / 127. A GGUF block's own scale varies every 32 (or 16) inputs, so no
  GGUF type maps exactly onto one scale per row.
- w4a8 ("q4" linears; the head "q6" where the file holds it in Q6_K or fewer bits, as llama.cpp's Q4_K_M files do,
  else "q8"): codes and per-group scale and offset (w = scale * q + offset) in fp16. From Q4_0 / Q4_1 blocks the
  weights are the file's exactly (fp16 is the file's own scale type); from Q4_K, scale = d * sub-block scale is
  rounded to fp16 (11-bit mantissa; int4 mode's bf16 has 8); other types are requantized per group (min/max, 16
  levels; q6: min/max, 64 levels; q8: max|w|/127 symmetric, 255 levels). Activations are rounded to int8 per row and
  group of 32 (scale max|x|/127), as llama.cpp's Q8_0 does: an approximation of its own, measured against bf16 in
  benchmarks/quant_bench.py.
The token embedding is a quantized table too (QEmbedding): a tied model's is the head's own table, an untied model's is
read from its GGUF's 4-bit blocks or requantized to int8 per row.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from .prepack import dense_state_dict, is_prepacked, prepacked_linear
from . import kernels

MODES = ("none", "int8", "int4", "w8a8", "w4a8")
BITS = {"q4": 4, "q6": 6, "q8": 8}   # QLinear kinds computed by kernels.qdot
GROUP = 32                       # int4 group size: the GGUF block (Q4_0/Q4_1) and Q4_K sub-block size
QBLOCK = 16                      # q4 / q6 / q8: outputs per block of qdot.cpp's layout (one vector of lanes)
QUAD = 4 * QBLOCK                # q4 / q6 / q8: outputs per quad (4 blocks whose records lie side by side)
CACHE_FORMAT = 10                # bump when the cached layout changes


def check_mode(mode: str | None) -> str:
    mode = mode or "none"
    if mode not in MODES:
        raise ModelError(f"unknown quantization {mode!r}", field="quant", remedy=f"use one of {', '.join(MODES)}")
    return mode


# -- the weight ---------------------------------------------------------------------------------------------------
class QLinear(nn.Module):
    """A quantized linear layer's weight (and bias). It stands in for the weight tensor: model code passes
    `module.weight` to `linear(x, w, b)`, which for a QLinear is the module itself and dispatches to its kernel.
    The packed tensors are buffers, so state_dict / safetensors caching and `.to()` work as for any module."""

    def __init__(self, kind: str, out_features: int, in_features: int, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, dtype=None):
        super().__init__()
        self.kind, self.out_features, self.in_features = kind, out_features, in_features
        self.register_buffer("qweight", qweight)   # int4: uint8 [N, K/2] (CPU pack); int8: int8 [N, K]; q*: q()
        self.register_buffer("scales", scales)     # int4: [K/32, N, 2] (scale, zero); int8: [N]; q4 / q6 / q8: None
        self.register_buffer("bias", bias)
        self._dtype = dtype or scales.dtype        # the activations' (model's) dtype

    @property
    def weight(self) -> "QLinear":
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @classmethod
    def int4(cls, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias=None,
             dtype=torch.bfloat16) -> "QLinear":
        """codes uint8 [N, K] in 0..15, scale/offset float32 [N, K/32]: w = scale * q + offset per group."""
        N, K = codes.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        zero = offset + 8 * scale                     # the kernel computes (q - 8) * scale + zero
        scales = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return cls("int4", N, K, packed, scales, None if bias is None else bias.to(dtype))

    @classmethod
    def int8(cls, q: torch.Tensor, scale: torch.Tensor, bias=None, dtype=torch.bfloat16) -> "QLinear":
        N, K = q.shape
        return cls("int8", N, K, q.contiguous(), scale.to(dtype), None if bias is None else bias.to(dtype))

    @classmethod
    def q(cls, bits: int, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias=None,
          dtype=torch.bfloat16) -> "QLinear":
        """For kernels.qdot: codes uint8 [N, K] (0..15, 0..63 or 0..255), scale / offset [N, K/32]: w = scale * q +
        offset. Stored in qdot.cpp's layout: outputs in blocks of 16 and blocks in quads of 4 (N padded with zero
        weights); a block's record for a group of 32 inputs is its codes, 64-byte rows of 16 outputs x 4 inputs
        (4-bit: rows 2p and 2p + 1 share row p as low and high nibbles, P = 4 rows; 6-bit: those 4 rows of the low 4
        bits and 2 rows of the high 2, P = 6; 8-bit: P = 8), then its 16 scales and 16 offsets in fp16; a quad's 4
        records of a group lie side by side: uint8 [N/64, K/32, 4, P * 64 + 64]."""
        N, K = codes.shape
        if K % GROUP:
            raise ModelError(f"the int8-activation kernel needs in_features divisible by 32, not {K}", field="quant")
        nq, ng = -(-N // QUAD), K // GROUP
        pad = nq * QUAD - N
        codes, scale, offset = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scale.float(), offset.float()))
        c = codes.reshape(nq, 4, QBLOCK, ng, 8, 4).permute(0, 3, 1, 4, 2, 5)    # [quad, group, block, row, output, 4]
        if bits < 8:               # 6-bit: the low 4 bits packed so, then 2 rows of high bits (row 4h + s: 2s, 2s+1)
            lo, hi = c & 0x0F, c >> 4
            c = lo[:, :, :, 0::2] | (lo[:, :, :, 1::2] << 4)
            if bits == 6:
                tops = sum(hi[:, :, :, s::4] << (2 * s) for s in range(4))
                c = torch.cat([c, tops.to(torch.uint8)], dim=3)
        halves = lambda t: t.reshape(nq, 4, QBLOCK, ng).permute(0, 3, 1, 2).to(torch.float16).contiguous()
        rec = torch.cat([c.reshape(nq, ng, 4, -1), *(halves(t).view(torch.uint8) for t in (scale, offset))], dim=-1)
        return cls(f"q{bits}", N, K, rec.contiguous(), None, None if bias is None else bias.to(dtype), dtype)

    @classmethod
    def empty(cls, kind: str, out_features: int, in_features: int, bias: bool, dtype: torch.dtype) -> "QLinear":
        """Placeholder tensors of the right shapes (meta device), for loading a cached state dict."""
        N, K = out_features, in_features
        with torch.device("meta"):
            if kind == "int4":
                qw, sc = torch.empty(N, K // 2, dtype=torch.uint8), torch.empty(K // GROUP, N, 2, dtype=dtype)
            elif kind == "int8":
                qw, sc = torch.empty(N, K, dtype=torch.int8), torch.empty(N, dtype=dtype)
            else:
                qw, sc = torch.empty(-(-N // QUAD), K // GROUP, 4, GROUP * QBLOCK * BITS[kind] // 8 + 64,
                                     dtype=torch.uint8), None
            b = torch.empty(N, dtype=dtype) if bias else None
        return cls(kind, N, K, qw, sc, b, dtype)

    def first_rows(self, n: int) -> "QLinear":
        """The first n outputs as a QLinear sharing this one's storage (a restricted draft head, draft/model.py).
        q4 / q6 / q8 need n a multiple of 64 (whole quads of the layout); the CPU int4 pack has no row slices."""
        if n >= self.out_features:
            return self
        if self.kind == "int8":
            parts = (self.qweight[:n], self.scales[:n])
        elif self.kind in BITS and n % QUAD == 0:
            parts = (self.qweight[:n // QUAD], None)
        else:
            raise ModelError(f"a {self.kind} weight cannot be cut to its first {n} rows", field="draft_vocab",
                             remedy=f"use a multiple of {QUAD} (q4 / q6 / q8) or another --quant")
        bias = None if self.bias is None else self.bias[:n]
        return QLinear(self.kind, n, self.in_features, *parts, bias, self._dtype)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()                              # the kernels want dense rows
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, GROUP, self.scales)
        elif self.kind in BITS:
            y = kernels.qdot(x, self.qweight, BITS[self.kind], self.out_features)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] as the kernel sees it, in float32 (for drafters that copy a head, and for tests)."""
        N, K = self.out_features, self.in_features
        if self.kind == "int8":
            return self.qweight.float() * self.scales.float()[:, None]
        if self.kind in BITS:
            return self._q_rows(slice(None))
        codes = unpack_int4(self.qweight, N, K).float().reshape(N, K // GROUP, GROUP)
        scale, zero = (self.scales[..., i].t().float()[..., None] for i in (0, 1))
        return ((codes - 8) * scale + zero).reshape(N, K)

    def __getitem__(self, rows) -> torch.Tensor:
        """Rows of the dequantised weight, in the model dtype (a drafter copying some of the head's rows, an int8
        embedding's lookup). int8 rows are dequantised alone, with dequantize's arithmetic."""
        if self.kind == "int8":
            return (self.qweight[rows].float() * self.scales[rows].float()[..., None]).to(self.dtype)
        if self.kind in BITS:
            return self._q_rows(rows).to(self.dtype)
        return self.dequantize()[rows].to(self.dtype)

    def _q_parts(self, blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q4 / q6 / q8: the packed records of these output blocks (all by default), by block: codes [blocks, groups,
        P, 16, 4] and the fp16 scale and offset [blocks, groups, 16]."""
        nq, ng, _, rec = self.qweight.shape
        recs = (self.qweight.transpose(1, 2).reshape(nq * 4, ng, rec) if blocks is None
                else self.qweight[blocks // 4, :, blocks % 4])
        half = lambda lo: recs[..., lo:lo + 32].contiguous().view(torch.float16)
        return recs[..., :rec - 64].reshape(len(recs), ng, -1, QBLOCK, 4), half(rec - 64), half(rec - 32)

    def _q_rows(self, rows) -> torch.Tensor:
        """float32 rows of a q4 / q6 / q8 weight: scale * code + offset per group, gathered from the packed layout."""
        idx = rows if torch.is_tensor(rows) else torch.arange(self.out_features, device=self.qweight.device)[rows]
        flat = idx.reshape(-1)
        each, lane = torch.arange(len(flat), device=flat.device), flat % QBLOCK
        codes, scales, offsets = self._q_parts(flat // QBLOCK)     # the rows' blocks only (an embedding lookup)
        q = codes[each, :, :, lane]                      # [L, groups, P, 4]
        if self.kind != "q8":      # packed row p: row 2p in the low nibble, row 2p + 1 in the high one
            lo = torch.stack([q[:, :, :4] & 0x0F, q[:, :, :4] >> 4], dim=3).reshape(len(flat), -1, 8, 4)
            if self.kind == "q6":  # then row 4h + s's high bits at bits 2s, 2s + 1 of row 4 + h
                hi = torch.stack([(q[:, :, 4:] >> (2 * s)) & 3 for s in range(4)], dim=3).reshape(lo.shape)
                lo = lo | (hi << 4)
            q = lo
        q = q.reshape(len(flat), -1, GROUP).float()
        scale, offset = (t[each, :, lane].float()[..., None] for t in (scales, offsets))
        return (q * scale + offset).reshape(*idx.shape, self.in_features)

    def group_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q4 / q6 / q8: the fp16 scale and offset [N, K/32] the kernel reads, back in output order."""
        return tuple(t.transpose(1, 2).reshape(-1, t.shape[1])[:self.out_features] for t in self._q_parts()[1:])

    def extra_repr(self) -> str:
        return f"{self.kind}, in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class QEmbedding(nn.Module):
    """The token embedding, dequantised on lookup. A tied model reads the rows of its quantized output head (int8,
    q8 or q6), so the table is held once (a bf16 lookup table beside the int8 head: 56 MB more for SmolLM2); an untied
    model reads its GGUF file's 4-bit blocks where it has them (GGUFRows: no table in memory), else holds its own
    int8 table (half the bf16 table)."""

    def __init__(self, head, owned: bool = False):
        super().__init__()
        if owned:
            self.table = head                         # a submodule: saved with the model
        object.__setattr__(self, "head", head)        # tied: the lm_head owns (and saves) these tensors

    @property
    def weight(self):
        return self.head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head[tokens]


class GGUFRows:
    """An untied model's token embedding looked up in its GGUF file's own 4-bit blocks (Q4_0 / Q4_1 / Q4_K) through
    np.memmap: only the pages of rows looked up become resident, and each row is the file's dequantised values
    rounded to the model dtype, exactly what the dense loader holds. It replaces an int8 copy of the table (223 MiB
    for Qwen2.5-Coder-1.5B) for 0.2 ms a step (8 rows). Stands in for the weight as QLinear does (dtype, device,
    shape, rows by index, dequantize)."""

    def __init__(self, path: str, offset: int, qtype: int, rows: int, cols: int, dtype: torch.dtype):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        self.spec = {"path": str(path), "offset": int(offset), "qtype": int(qtype), "rows": rows, "cols": cols}
        self.qtype = GGMLQuantizationType(qtype)
        self.dtype, self.device, self.shape = dtype, torch.device("cpu"), torch.Size((rows, cols))
        elems, nbytes = GGML_QUANT_SIZES[self.qtype]
        self.data = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(rows, cols // elems * nbytes))

    def _rows(self, idx: np.ndarray) -> torch.Tensor:
        return dequantize_int4(*gguf_int4(self.data[idx], self.qtype, (len(idx), self.shape[1])))

    def __getitem__(self, rows) -> torch.Tensor:
        idx = torch.as_tensor(rows)
        out = self._rows(idx.reshape(-1).numpy()).to(self.dtype)
        return out.reshape(*idx.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        return torch.cat([self._rows(np.arange(i, min(i + 4096, self.shape[0])))
                          for i in range(0, self.shape[0], 4096)])


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a weight tensor; the packed kernel for a QLinear (which carries its own bias); oneDNN's for a
    weight prepacked for it (engine/prepack.py: the same bits as F.linear)."""
    if isinstance(w, QLinear):
        return w.mm(x)
    if is_prepacked(w):
        return prepacked_linear(x, w, b)
    if kernels.bf16_linear_usable(x, w, b):
        return kernels.bf16_linear(x, w, b)
    return F.linear(x, w, b)


def unpack_int4(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The codes uint8 [N, K] back out of the CPU kernel's packed layout, read through the kernel itself: with one-hot
    rows of x and scale 1 / zero 8 per group, it returns exactly the codes (small integers are exact in any float)."""
    ones = torch.stack([torch.ones(K // GROUP, N), torch.full((K // GROUP, N), 8.0)], dim=-1)
    cols = []
    for k0 in range(0, K, 1024):                    # 1024 one-hot rows at a time: eye(K) whole is K^2 floats
        n = min(1024, K - k0)
        onehot = torch.zeros(n, K)
        onehot[torch.arange(n), torch.arange(k0, k0 + n)] = 1
        cols.append(torch.ops.aten._weight_int4pack_mm_for_cpu(onehot, packed, GROUP, ones))
    return torch.cat(cols).t().round().to(torch.uint8)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QLinear) for m in model.modules())


# -- quantizers (float32 in, codes + scales out) ---------------------------------------------------------------------
def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max per group of 32: codes uint8 [N, K], scale and offset float32 [N, K/32]."""
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))   # a constant group: every code 0, offset = value
    codes = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(N, K)
    return codes, scale, lo


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output row: q int8 [N, K] in -127..127, scale float32 [N]."""
    scale = w.float().abs().amax(1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w.float() / safe[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def is_int4_block(qtype) -> bool:
    """Whether gguf_int4 reads this GGUF block type's 4-bit codes as they are (Q4_0 / Q4_1 / Q4_K)."""
    from gguf import GGMLQuantizationType as Q
    return qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K)


def gguf_int4(data: np.ndarray, qtype, shape: tuple[int, int]):
    """The 4-bit codes of Q4_0 / Q4_1 / Q4_K blocks as they are, with each group's scale and offset (float32),
    such that scale * q + offset equals gguf.dequantize bitwise. None for any other block type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    from gguf.quants import Q4_K
    if not is_int4_block(qtype):
        return None
    N, K = shape
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    f16 = lambda a: a.copy().view(np.float16).astype(np.float32)     # noqa: E731
    if qtype == Q.Q4_K:   # 256 = 8 sub-blocks of 32: d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        d, dmin = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = d * sc.astype(np.float32)                              # [n, 8]
        offset = -(dmin * mn.astype(np.float32))
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    else:                 # 32: d (Q4_1: d, m), 16 bytes of nibbles (low nibbles are elements 0..15)
        d = f16(blocks[:, 0:2])
        scale = d
        offset = f16(blocks[:, 2:4]) if qtype == Q.Q4_1 else -8 * d
        qs = blocks[:, -16:].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    codes = (qs & 0x0F).reshape(N, K)
    return (torch.from_numpy(codes), torch.from_numpy(scale.reshape(N, K // GROUP)),
            torch.from_numpy(offset.reshape(N, K // GROUP)))


def dequantize_int4(codes, scale, offset) -> torch.Tensor:
    """float32 weights of (codes, scale, offset): the slow reference."""
    N, K = codes.shape
    return (codes.float().reshape(N, K // GROUP, GROUP) * scale[..., None] + offset[..., None]).reshape(N, K)


# -- whole models ------------------------------------------------------------------------------------------------------
def _gguf_parts(name: str, tied: bool) -> list[str]:
    """GGUF tensor names that make up one of our (possibly fused) linears."""
    if name == "lm_head":
        return ["token_embd.weight" if tied else "output.weight"]
    i, rest = name.split(".")[1], name.split(".", 2)[2]
    parts = {"attn.wqkv": ["attn_q", "attn_k", "attn_v"], "attn.wo": ["attn_output"],
             "mlp.w_gate_up": ["ffn_gate", "ffn_up"], "mlp.w_down": ["ffn_down"]}[rest]
    return [f"blk.{i}.{p}.weight" for p in parts]


def _kind(mode: str, name: str, qtype=None) -> str:
    """The linear kind of `name` in `mode`, read from a GGUF tensor of type `qtype` (None: no file). The output head
    keeps 8 bits in int4; in w4a8 it keeps 6 where the file holds it in at most 6.5 bits a weight (Q6_K in llama.cpp's
    Q4_K_M files), else 8 (a Q8_0 head, e.g. SmolLM2's, loses precision in 6 bits: KL to bf16 0.0058 -> 0.0083)."""
    if mode in ("w8a8", "w4a8"):
        if mode == "w8a8":
            return "q8"
        if name != "lm_head":
            return "q4"
        from gguf import GGML_QUANT_SIZES
        block, size = GGML_QUANT_SIZES.get(qtype, (1, 4))              # no file or an unknown type: as float32
        return "q6" if 8 * size / block <= 6.5625 else "q8"
    return "int8" if mode == "int8" or name == "lm_head" else "int4"


def quantize_model(model, mode: str, gguf_path: str | os.PathLike | None = None):
    """Replace the model's linears by QLinears in place (and return it). With `gguf_path` (the file the model was
    loaded from), weights are read from the file's blocks: 4-bit codes kept exactly where possible (see the module
    doc); else they are requantized from the model's own weights."""
    mode = check_mode(mode)
    if mode == "none":
        return model
    dtype = model.embed.weight.dtype
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ModelError(f"quantized execution needs a bf16/fp16/fp32 model, not {dtype}", field="quant",
                         remedy="load the model with --dtype bf16")
    if model.embed.weight.device.type != "cpu":
        raise ModelError("quantized execution is implemented for CPU only", field="quant")
    tensors = {}
    if gguf_path is not None:
        from .loader import read_gguf
        tensors = {t.name: t for t in read_gguf(gguf_path).tensors}
    tied = model.lm_head is None
    for name, lin in model.linears().items():
        w = model.embed.weight if lin is None else lin.weight
        bias = None if lin is None else lin.bias
        parts = [tensors[p] for p in (_gguf_parts(name, tied) if tensors else [])]
        kind = _kind(mode, name, parts[0].tensor_type if len(parts) == 1 else None)
        setattr_path(model, name, _quantize_one(kind, w, bias, parts, model.cfg, dtype))
    table = tensors.get("token_embd.weight")
    if tied:
        model.embed = QEmbedding(model.lm_head)
    elif table is not None and is_int4_block(table.tensor_type):
        model.embed = QEmbedding(GGUFRows(gguf_path, table.data_offset, table.tensor_type, model.cfg.vocab_size,
                                          model.cfg.dim, dtype))
    else:
        model.embed = QEmbedding(QLinear.int8(*quantize_int8(model.embed.weight.float()), dtype=dtype), owned=True)
    return model


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric per group of 32 as unsigned codes for qdot: q = round(w / s) + 128 in 1..255, s = max|w| / 127,
    offset = -128 s. Returns codes uint8 [N, K], scale and offset float32 [N, K/32]."""
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    scale = g.abs().amax(-1) / 127
    # fp16 holds the scale: quantize with the rounded one (and keep a zero group's codes at 128)
    scale = scale.to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((g / safe[..., None]).round().clamp(-127, 127) + 128).to(torch.uint8).reshape(N, K)
    return codes, scale, -128 * scale


def quantize_q6(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max per group of 32, 64 levels, with the scale and offset qdot reads (fp16): codes uint8 [N, K]
    in 0..63, scale and offset float32 [N, K/32]. Every weight within half a step of its group's grid (a Q6_K
    file's own scales vary every 16 inputs, so its weights are requantized)."""
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    lo = g.amin(-1).to(torch.float16).float()
    scale = ((g.amax(-1) - lo) / 63).to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 63).to(torch.uint8).reshape(N, K)
    return codes, scale, lo


def _quantize_one(kind, w, bias, gguf_tensors, cfg, dtype) -> QLinear:
    if kind == "int8":
        return QLinear.int8(*quantize_int8(w.float()), bias=bias, dtype=dtype)
    if kind in ("q6", "q8"):
        quantize = quantize_q6 if kind == "q6" else quantize_q8
        return QLinear.q(BITS[kind], *quantize(w.float()), bias=bias, dtype=dtype)
    pieces, start = [], 0
    for t in gguf_tensors or [None]:
        n = w.shape[0] if t is None else int(t.shape[-1])
        exact = None if t is None else gguf_int4(t.data, t.tensor_type, (n, w.shape[1]))
        if exact is not None and cfg.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            from .loader import _unpermute   # llama.cpp interleaves Llama q/k rows; the model holds them unpermuted
            heads = cfg.n_heads if t.name.endswith("attn_q.weight") else cfg.n_kv_heads
            exact = tuple(torch.from_numpy(_unpermute(a.numpy(), heads).copy()) for a in exact)
        # Not 4-bit blocks: requantize the (already dequantised) model weights of these rows.
        pieces.append(exact if exact is not None else quantize_int4(w[start:start + n].float()))
        start += n
    codes, scale, offset = (torch.cat(p) for p in zip(*pieces))
    if kind == "q4":
        return QLinear.q(4, codes, scale, offset, bias=bias, dtype=dtype)
    return QLinear.int4(codes, scale, offset, bias=bias, dtype=dtype)


def setattr_path(root: nn.Module, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        root = getattr(root, p)
    setattr(root, leaf, value)


# -- cache (a quantized model as one safetensors file + a json description) ------------------------------------------
def save_quantized(model, path: str | os.PathLike) -> Path:
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = {name: [m.kind, m.out_features, m.in_features, m.bias is not None]
            for name, m in model.named_modules() if isinstance(m, QLinear)}
    meta = {"format": CACHE_FORMAT, "torch": torch.__version__, "cfg": dataclasses.asdict(model.cfg),
            "dtype": str(model.embed.weight.dtype).removeprefix("torch."), "linears": spec,
            "embed": ("lm_head" if model.lm_head is model.embed.weight else
                      {"gguf": model.embed.weight.spec} if isinstance(model.embed.weight, GGUFRows) else "int8")}
    (path / "quant.json").write_text(json.dumps(meta, indent=1))
    save_file({k: v.contiguous() for k, v in dense_state_dict(model).items()}, str(path / "model.safetensors"))
    return path


def load_quantized(path: str | os.PathLike):
    from safetensors.torch import load_file

    from .hugepages import copy_to_huge_pages
    from .model import ModelConfig, Transformer, rope_tables
    path = Path(path)
    meta = json.loads((path / "quant.json").read_text())
    if meta.get("format") != CACHE_FORMAT or meta.get("torch") != torch.__version__:
        raise ModelError(f"{path}: quantized cache of another format / torch version")
    cfg, dtype = ModelConfig(**meta["cfg"]), getattr(torch, meta["dtype"])
    with torch.device("meta"):
        model = Transformer(cfg)
    for name, (kind, n, k, bias) in meta["linears"].items():
        setattr_path(model, name, QLinear.empty(kind, n, k, bias, dtype))
    # load_state_dict fills these modules' buffers in place
    if meta["embed"] == "lm_head":
        model.embed = QEmbedding(model.lm_head)
    elif isinstance(meta["embed"], dict):
        model.embed = QEmbedding(GGUFRows(**meta["embed"]["gguf"], dtype=dtype))
    else:
        model.embed = QEmbedding(QLinear.empty("int8", cfg.vocab_size, cfg.dim, False, dtype), owned=True)
    # copied: safetensors hands out tensors at whatever offset they sit in the file; the packed kernels' vector
    # loads crashed (SIGSEGV) on such views of a cached lm_head. The copies are aligned, and in huge pages, which a
    # decode step's stream through every weight reads with fewer page walks (hugepages.py).
    state = copy_to_huge_pages(load_file(str(path / "model.safetensors")))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if [m for m in missing if "rope" not in m] or unexpected:
        raise ModelError(f"{path}: cached weights do not fit: missing {missing}, unexpected {unexpected}")
    # in the model dtype, as loader.py's model.to(dtype) leaves them (the same values forward's cast would give):
    # float64 tables of 32k positions would hold 64 MiB
    model.rope_cos, model.rope_sin = (t.to(dtype) for t in rope_tables(cfg))
    return model.eval()
