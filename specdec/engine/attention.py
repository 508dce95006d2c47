"""Attention over the paged KV cache, two ways.

`attend_fast`: one SDPA call per sequence (its new rows against its cached prefix + causally within them). Fast for
one sequence, but its kernels reduce in an order that depends on how many query rows share the call: a row's output
in a 4-row verify differs in the last bits from the same row decoded alone, and in bf16 that can flip a near-tie token.

`attend_invariant` (the default, see Engine(batch_invariant=...)): a row's output is a function of that row alone, bit
for bit, whatever else is in the forward (other sequences, other rows of its own sequence, chunk sizes, verify vs
decode). Three rules make it so:
  - Key length: a row at absolute position p attends to keys 0..p, read in a padded length Lp = ceil((p+1)/KEY_BLOCK)
    * KEY_BLOCK that depends on p only (the padding is masked). Rows are grouped by Lp, so every reduction over keys
    has the same length for a row whether it runs alone or in a pack; sequences whose rows share (Lp, row count) are
    stacked into one batched GEMM (one per layer for a whole decode step, not one per sequence).
  - Query tiles: the score and value GEMMs run on fixed tiles of QUERY_TILE rows (padded), batched, so every GEMM has
    one shape. BLAS picks kernels by row count (measured here: MKL's float32 GEMM gives a row different bits at 1-3
    rows than at >= 4, and float64 differs again on ragged tails); with one shape there is one kernel.
  - Accumulation: scores, softmax and the weighted sum in float32 for bf16/fp16 models (the model dtype otherwise),
    softmax per row over the fixed padded length. The engine keeps the KV cache in that dtype, so the gathers below
    need no cast.
That is `attend_gemm`. On a CPU that builds our kernels, bf16/fp16 models run `attend_kernel` instead (one C++ call
per group, kernels/layer_ops.cpp): each (row, head) reads exactly its own keys from the paged cache and reduces in
one fixed order, invariant by construction with no padding or tiles, and one op where the GEMM schedule runs ~15
(decode is dispatch-bound). The two round differently (float32 summation order).
Norms, RoPE and the MLP's pointwise ops are per-row already; linears run on the window of row counts where a
start-up probe finds the BLAS row-invariant (engine/row_tiles.py).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from . import kernels

KEY_BLOCK = 64       # keys are read in multiples of this (the padding is masked)
QUERY_TILE = 8       # every score / value GEMM has exactly this many query rows


@dataclasses.dataclass
class AttnGroup:
    """S sequences' rows that share one padded key length Lp, stacked into one batched GEMM per layer (one per
    distinct Lp in the forward, not one per sequence: decode rows and verify blocks of every sequence whose context
    rounds up to the same Lp). Each sequence's rows are padded to the group's widest (rows -1, zero mask): the GEMM
    runs on query tiles of QUERY_TILE rows whatever the padding, so a row's arithmetic is the same with or without
    other sequences in its group (see attend_invariant_ref)."""
    rows: torch.Tensor        # [S, m] rows in the flat batch, -1 for padding (at the end of a sequence's rows)
    slots: torch.Tensor       # [S, Lp] KV slots to read (padding points at position 0's slot: finite, then masked)
    mask: torch.Tensor        # [S, m * g, Lp] additive float mask per (row, head in kv group): 0 for keys the row
                              # sees, -inf beyond its position
    lens: torch.Tensor        # [S, m] keys each row sees (0 for padding): what the CPU kernel reads instead of mask
    _index: dict = dataclasses.field(default_factory=dict, repr=False)

    def index(self, T: int, Hkv: int, g: int, rs: int) -> tuple[torch.Tensor, ...]:
        """Gather indices, built by the first layer and reused by the others (every layer has the same layout):
        q rows straight into GEMM layout [S, Hkv, Mp] from q's rows of `rs` head vectors (padding query rows read
        row 0: a finite row whose outputs are never gathered back, and a row's scores do not depend on the other
        rows of its tile), K/V rows of the flat
        [slots * Hkv, hd] cache, the GEMM output of the real rows back into [rows, H] order, the mask padded to Mp
        rows, the real rows, and whether they are every row of the forward in order (the output is then the
        layer's output)."""
        if (T, Hkv, g, rs) not in self._index:
            S, m = self.rows.shape
            M, H, dev = m * g, Hkv * g, self.rows.device
            Mp = -(-M // QUERY_TILE) * QUERY_TILE
            t = torch.arange(Mp, device=dev)
            kvh = torch.arange(Hkv, device=dev)
            head = kvh[None, :, None] * g + (t % g)[None, None, :]                              # [1, Hkv, Mp]
            row = self.rows[:, None, (t // g).clamp(max=m - 1)]                                 # [S, 1, Mp]
            q_idx = torch.where((t < M) & (row >= 0), row * rs + head, 0).reshape(-1)
            kv_idx = (self.slots[:, None, :] * Hkv + kvh[None, :, None]).reshape(-1)
            h = torch.arange(H, device=dev)
            o_idx = (torch.arange(S, device=dev)[:, None, None] * (Hkv * Mp) + (h // g)[None, None, :] * Mp
                     + torch.arange(m, device=dev)[None, :, None] * g + (h % g)[None, None, :])    # [S, m, H]
            real = self.rows >= 0
            o_idx, rows = o_idx[real].reshape(-1), self.rows[real]
            mask = self.mask.new_zeros(S, 1, Mp, self.mask.shape[-1])
            mask[:, 0, :M] = self.mask
            whole = rows.numel() == T and bool((rows == torch.arange(T, device=dev)).all())
            self._index[T, Hkv, g, rs] = q_idx, kv_idx, o_idx, mask, rows, whole
        return self._index[T, Hkv, g, rs]


def plan_groups(layout, dtype: torch.dtype, device, heads_per_kv: int) -> list[AttnGroup]:
    """Computed once per forward from the layout, shared by every layer."""
    acc = acc_dtype(dtype)
    buckets: dict[int, list] = {}
    for s in layout.seqs:
        start = s.read_slots.numel() - s.n
        lens = torch.arange(start + 1, start + s.n + 1)                 # keys each new row sees
        padded = (lens + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK
        i = 0
        while i < s.n:
            lp = int(padded[i])
            j = i + int((padded[i:] == lp).sum())
            slots = s.read_slots[:lp] if lp <= s.read_slots.numel() else torch.cat(
                [s.read_slots, s.read_slots[:1].expand(lp - s.read_slots.numel())])
            mask = torch.zeros(j - i, lp, dtype=acc)
            mask.masked_fill_(torch.arange(lp)[None, :] >= lens[i:j, None], float("-inf"))
            buckets.setdefault(lp, []).append((torch.arange(s.row0 + i, s.row0 + j), slots, mask, lens[i:j]))
            i = j
        for i, read in enumerate(s.leaves):        # a leaf reads its own slot list, padded as its position is
            n, lp = read.numel(), -(-read.numel() // KEY_BLOCK) * KEY_BLOCK
            slots = torch.cat([read, read[:1].expand(lp - n)])
            mask = torch.zeros(1, lp, dtype=acc)
            mask[:, n:] = float("-inf")
            buckets.setdefault(lp, []).append((torch.tensor([s.row0 + s.n + i]), slots, mask, torch.tensor([n])))
    groups = []
    for members in buckets.values():
        m = max(r.numel() for r, *_ in members)
        rows = torch.stack([F.pad(r, (0, m - r.numel()), value=-1) for r, *_ in members])
        mask = torch.stack([F.pad(k, (0, 0, 0, m - k.shape[0])).repeat_interleave(heads_per_kv, 0)
                            for _, _, k, _ in members])
        lens = torch.stack([F.pad(n, (0, m - n.numel())) for *_, n in members])
        groups.append(AttnGroup(rows.to(device), torch.stack([sl for _, sl, _, _ in members]).to(device),
                                mask.to(device), lens.to(device)))
    return groups


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def kernel_attention(q, k_cache) -> bool:
    """Whether attend_invariant runs attend_kernel for these: on a CPU with our kernels, a bf16 / fp16 model with its
    float32 cache (model.Transformer's fused blocks run that kernel too, so they ask the same question)."""
    return q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == torch.float32 and kernels.usable(q)


def attend_invariant(q, k_cache, v_cache, groups: list[AttnGroup]):
    """q [T, H, hd] -> [T, H * hd]. k_cache/v_cache [slots, Hkv, hd] already hold this forward's keys/values.
    On a CPU with our kernels, bf16 / fp16 models (float32 cache) run attend_kernel; otherwise attend_gemm."""
    if kernel_attention(q, k_cache):
        return attend_kernel(q, k_cache, v_cache, groups)
    return attend_gemm(q, k_cache, v_cache, groups)


def attend_kernel(q, k_cache, v_cache, groups: list[AttnGroup]):
    """One call per group of the C++ kernel (kernels/layer_ops.cpp `attend`): each (row, head) reads its keys straight
    from the paged cache, in float32, in one fixed order, so a row's bits depend on that row alone (no padding or
    tiles needed); the rows and heads sharing a kv head share its reads. Decode is dispatch-bound: this is one op
    where attend_gemm runs ~15."""
    T, H, hd = q.shape
    if q.stride(2) != 1 or q.stride(1) != hd:
        q = q.contiguous()
    out = torch.empty(T, H * hd, dtype=q.dtype, device=q.device)
    for grp in groups:
        kernels.attend(q, k_cache, v_cache, grp.rows, grp.slots, grp.lens, 1.0 / math.sqrt(hd), out)
    return out


def _tree8(a: torch.Tensor) -> torch.Tensor:
    """kernels/fixed_sums.h's tree over the last dimension's 8 partial sums."""
    return ((a[..., 0] + a[..., 1]) + (a[..., 2] + a[..., 3])) + ((a[..., 4] + a[..., 5]) + (a[..., 6] + a[..., 7]))


def _strided_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension as the kernel sums: 8 strided float32 partial sums in index order, then the tree."""
    n = x.shape[-1]
    acc = torch.zeros(*x.shape[:-1], 8, dtype=torch.float32)
    for i in range(0, n - n % 8, 8):
        acc = acc + x[..., i:i + 8]
    for i in range(n - n % 8, n):
        acc[..., i % 8] = acc[..., i % 8] + x[..., i]
    return _tree8(acc)


def _exp_le0(x: torch.Tensor) -> torch.Tensor:
    """layer_ops.cpp's exp_le0 as float32 tensor ops, one IEEE operation each, in its order."""
    f = lambda c: torch.tensor(c, dtype=torch.float32)  # noqa: E731 - the C++ float literals
    under = x < -87
    xc = torch.where(under, f(-87.0), x)
    k = (xc * f(1.44269504088896341) + f(12582912.0)) - f(12582912.0)
    r = (xc - k * f(0.693359375)) - k * f(-2.12194440e-4)
    y = f(1.9875691500e-4).expand_as(r)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = y * r + f(c)
    y = (y * (r * r) + r) + f(1.0)
    scale = ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(under, f(0.0), y * scale)


def attend_kernel_ref(q, k_cache, v_cache, groups: list[AttnGroup]):
    """attend_kernel's arithmetic as float32 tensor ops, a row at a time (all heads at once): each score an 8-strided
    dot product ended by the fixed tree, times the scale; exp_le0 of score - max; the 8-strided sum; each weight
    divided by it; the weighted sum of values in key order, one rounded multiply and add a key. The C++ kernel must
    give these bits exactly (tests), however it vectorises or splits the work. Slow: a reference."""
    T, H, hd = q.shape
    heads = torch.arange(H) // (H // k_cache.shape[1])   # each query head's kv head
    scale = torch.tensor(1.0 / math.sqrt(hd), dtype=torch.float32)
    out = torch.zeros(T, H * hd, dtype=q.dtype)
    for grp in groups:
        for row, L, sl in ((int(r), int(n), grp.slots[i]) for i in range(grp.rows.shape[0])
                           for r, n in zip(grp.rows[i], grp.lens[i])):
            if row < 0 or L <= 0:
                continue
            k = k_cache[sl[:L]][:, heads].transpose(0, 1)            # [H, L, hd]
            v = v_cache[sl[:L]][:, heads].transpose(0, 1)
            scores = _strided_sum(q[row].float()[:, None, :] * k) * scale   # [H, L]
            p = _exp_le0(scores - scores.max(dim=1, keepdim=True).values)
            p = p / _strided_sum(p)[:, None]
            o = torch.zeros(H, hd, dtype=torch.float32)
            for j in range(L):
                o = o + p[:, j:j + 1] * v[:, j]
            out[row] = o.to(q.dtype).reshape(-1)
    return out


def attend_gemm(q, k_cache, v_cache, groups: list[AttnGroup]):
    """The same as batched GEMMs. Per group: three gathers into GEMM layout, two batched GEMMs of QUERY_TILE rows, one
    gather back (decode is dispatch-bound, so every reshuffle is a precomputed index rather than a permute and a
    copy)."""
    T, H, hd = q.shape
    Hkv = k_cache.shape[1]
    g = H // Hkv
    acc = acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(hd)
    if q.stride(2) != 1 or q.stride(1) != hd:
        q = q.contiguous()
    rs = q.stride(0) // hd             # head vectors per row: q is usually the q part of the fused rotated q|k rows
    qf = q.as_strided(((T - 1) * rs + H, hd), (hd, 1))                     # read in place, no copy
    out = None
    for grp in groups:
        S = grp.rows.shape[0]
        Lp = grp.slots.shape[1]
        q_idx, kv_idx, o_idx, mask, rows, whole = grp.index(T, Hkv, g, rs)
        Mp = mask.shape[2]
        # Explicit bmm over (sequence, kv head, query tile): matmul would fold the tiles of a lone [1, tiles] batch
        # into one GEMM of tiles * 8 rows, whose bits differ (seen in float64 with one kv head per TP rank).
        B, nt = S * Hkv, Mp // QUERY_TILE
        qt = qf.index_select(0, q_idx).to(acc).view(B * nt, QUERY_TILE, hd)
        kt = k_cache.view(-1, hd).index_select(0, kv_idx).to(acc).view(B, 1, Lp, hd)
        vt = v_cache.view(-1, hd).index_select(0, kv_idx).to(acc).view(B, 1, Lp, hd)
        kt, vt = (t.expand(B, nt, Lp, hd).reshape(B * nt, Lp, hd) for t in (kt, vt))   # a view when nt == 1
        s = torch.bmm(qt, kt.transpose(1, 2)).view(S, Hkv, Mp, Lp).mul_(scale).add_(mask)   # padding rows: + 0
        p = torch.softmax(s, dim=-1)
        o = torch.bmm(p.view(B * nt, QUERY_TILE, Lp), vt).view(-1, hd)
        o = o.index_select(0, o_idx).view(-1, H * hd).to(q.dtype)
        if whole:
            return o
        if out is None:
            out = torch.empty(T, H * hd, dtype=q.dtype, device=q.device)
        out.index_copy_(0, rows, o)
    return out if out is not None else q.new_empty(T, H * hd)


def attend_invariant_ref(q, k_cache, v_cache, groups: list[AttnGroup]):
    """One sequence at a time, each with only its own rows (the pre-batching schedule): the tests hold
    attend_invariant to these bits, i.e. a row's output does not depend on which sequences share its batched GEMM
    or how far its rows were padded."""
    T, H, hd = q.shape
    g = H // k_cache.shape[1]
    out = torch.empty(T, H * hd, dtype=q.dtype, device=q.device)
    for grp in groups:
        for i in range(grp.rows.shape[0]):
            r = grp.rows[i][grp.rows[i] >= 0]
            alone = AttnGroup(r[None], grp.slots[i:i + 1], grp.mask[i:i + 1, :r.numel() * g],
                              grp.lens[i:i + 1, :r.numel()])
            out[r] = attend_invariant(q, k_cache, v_cache, [alone])[r]
    return out


def attend_fast(q, k_cache, v_cache, layout):
    """One SDPA call per sequence: its new rows against its cached prefix + causally within them. (Batching the
    sequences into one padded SDPA call was measured slower here: 160 vs 142 ms for 32 decode rows of SmolLM2.)"""
    out = torch.empty_like(q)
    for s in layout.seqs:
        qs = q[s.row0:s.row0 + s.n].transpose(0, 1)[None]                 # [1, H, n, hd]
        ks = k_cache.index_select(0, s.read_slots).transpose(0, 1)[None]  # [1, Hkv, ctx, hd]
        vs = v_cache.index_select(0, s.read_slots).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=s.mask, enable_gqa=True)
        out[s.row0:s.row0 + s.n] = o[0].transpose(0, 1)
        for i, read in enumerate(s.leaves):        # a leaf row sees its own slots, all of them
            r = s.row0 + s.n + i
            ks, vs = (c.index_select(0, read).transpose(0, 1)[None] for c in (k_cache, v_cache))
            o = F.scaled_dot_product_attention(q[r:r + 1].transpose(0, 1)[None], ks, vs, enable_gqa=True)
            out[r:r + 1] = o[0].transpose(0, 1)
    return out.view(q.shape[0], -1)
