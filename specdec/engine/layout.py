"""Packing many sequences' new rows into one flat forward.

`pack` turns per-sequence inputs into the flat token tensor plus a `Layout`: each row's absolute position and KV
write slot, cu_seqlens, and per sequence the slots it reads (cached prefix + its own new rows) and its causal mask.
It is computed once per forward and shared by every layer.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..errors import InvalidRequest
from .kv_cache import KVPool


@dataclasses.dataclass
class SeqInput:
    """New rows of one sequence. `start` None appends at the cached length; a smaller start rolls back first."""
    seq: int
    tokens: Sequence[int] | torch.Tensor
    start: int | None = None
    logits: str = "last"          # "last" | "all" | "none"
    leaves: Sequence[tuple[int, int]] = ()  # (depth, token) rows of a verify tree (below), run after the chain rows


# A tree's leaf (depth d, token x) is an alternative to the sequence's new row d (1 <= d < n): it sits at that row's
# position start + d and sees the sequence's first start + d positions and itself, as if x had been fed there; its
# K/V are written past the chain (the slots of positions start + n + i), so the chain's stay as they are. It adds one
# row (with logits when the input asks for all), not a copy of its path.


@dataclasses.dataclass
class SeqRows:
    row0: int                     # first row in the flat batch
    n: int                        # new rows
    read_slots: torch.Tensor      # [start + n] KV slots of positions 0 .. start+n-1
    seq: int = -1                 # the KV sequence (-1 where unknown: a tensor-parallel worker's decoded layout)
    leaves: list[torch.Tensor] = dataclasses.field(default_factory=list)  # per leaf row (rows row0 + n + i): the
    #                                                 slots it reads, its own last

    @property
    def mask(self) -> torch.Tensor | None:
        """[n, start + n] causal bool mask for the fast SDPA path; None when a single row sees everything."""
        start = self.read_slots.numel() - self.n
        return None if self.n == 1 else torch.ones(self.n, start + self.n, dtype=torch.bool).tril(diagonal=start)


@dataclasses.dataclass
class Layout:
    tokens: torch.Tensor          # [T]
    positions: torch.Tensor       # [T] absolute positions
    write_slots: torch.Tensor     # [T]
    cu_seqlens: torch.Tensor      # [B + 1]
    seqs: list[SeqRows]
    logit_rows: torch.Tensor      # rows whose logits are returned, in input order
    cu_logits: list[int]          # logits of input i are logit rows cu_logits[i] : cu_logits[i + 1]
    attn_groups: list | None = None  # batch-invariant attention plan (engine.attention.plan_groups), None: fast SDPA


def pack(inputs: list[SeqInput], kv: KVPool, vocab_size: int, max_seq_len: int) -> Layout:
    """Validate, reserve KV for every input (all-or-nothing), and lay the rows out flat."""
    if not inputs:
        raise InvalidRequest("a forward needs at least one sequence", field="inputs")
    if len({i.seq for i in inputs}) != len(inputs):
        raise InvalidRequest("a sequence appears twice in one forward", field="inputs")
    toks, spans = [], []
    for inp in inputs:
        t = torch.as_tensor(inp.tokens, dtype=torch.long).reshape(-1)
        if t.numel() == 0:
            raise InvalidRequest("no tokens to run", field="tokens", remedy="send at least one token")
        if int(t.min()) < 0 or int(t.max()) >= vocab_size:
            bad = int(t[(t < 0) | (t >= vocab_size)][0])
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})", field="tokens")
        start = kv.length(inp.seq) if inp.start is None else inp.start
        if start + t.numel() > max_seq_len:
            raise InvalidRequest(f"{start + t.numel()} tokens exceed the model context of {max_seq_len}",
                                 field="prompt", remedy="shorten the prompt or lower max_tokens")
        if any(not 1 <= d < t.numel() or not 0 <= x < vocab_size for d, x in inp.leaves):
            raise InvalidRequest("a leaf's depth must name a new row after the first and its token be in the "
                                 "vocabulary", field="leaves")
        toks.append(torch.cat([t, torch.tensor([x for _, x in inp.leaves], dtype=torch.long)]))
        spans.append((inp.seq, start, t.numel(), len(inp.leaves)))
    kv.write([(sid, start, n + m) for sid, start, n, m in spans])

    positions, writes, seqs, logit_rows, cu_logits, row0 = [], [], [], [], [0], 0
    for inp, (sid, start, n, m) in zip(inputs, spans):
        read = kv.slots(sid, 0, start + n + m)
        depth = torch.tensor([d for d, _ in inp.leaves], dtype=torch.long)
        positions += [torch.arange(start, start + n), start + depth]
        writes.append(read[start:])
        leaves = [torch.cat([read[:start + d], read[start + n + i:start + n + i + 1]]) for i, (d, _) in
                  enumerate(inp.leaves)]
        seqs.append(SeqRows(row0, n, read[:start + n], sid, leaves))
        rows = {"last": [row0 + n - 1], "all": list(range(row0, row0 + n + m)), "none": []}[inp.logits]
        logit_rows += rows
        cu_logits.append(cu_logits[-1] + len(rows))
        row0 += n + m
    lens = torch.tensor([s.n + len(s.leaves) for s in seqs])
    return Layout(tokens=torch.cat(toks), positions=torch.cat(positions), write_slots=torch.cat(writes),
                  cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]), seqs=seqs,
                  logit_rows=torch.tensor(logit_rows, dtype=torch.long), cu_logits=cu_logits)
