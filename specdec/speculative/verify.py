"""Verify layouts: how draft blocks of many requests become one target forward.

compact: request i brings exactly verify_len_i rows — its anchor and its first verify_len_i - 1 draft tokens — so the
         forward runs sum(verify_len) rows and a shorter verify_len saves real compute.
padded:  every request brings W = gamma + 1 rows (missing drafts padded); rows past verify_len are computed and thrown
         away. The fixed shape is what graph capture wants; here it is the A/B baseline and fallback.

Either way each request gets the target logits of its first verify_len rows, and its KV holds the anchor and drafts
until the commit truncates it to what was accepted.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..engine.engine import Engine
from ..engine.layout import SeqInput

LAYOUTS = ("compact", "padded")
PAD_TOKEN = 0


@dataclasses.dataclass
class VerifyItem:
    seq: int                  # the request's target KV sequence
    anchor_pos: int           # committed_len - 1
    anchor: int
    drafts: list[int]
    verify_len: int           # 1 .. len(drafts) + 1
    leaves: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (depth < verify_len, token)


def verify(engine: Engine, items: list[VerifyItem], layout: str = "compact", width: int | None = None,
           prefill: Sequence[SeqInput] = ()) -> tuple[list[torch.Tensor], int]:
    """Target logits [verify_len_i + leaves_i, V] per item (the chain's rows, then its leaves' in order) and the
    number of rows the forward ran. `prefill`: other sequences' context rows (no logits) packed into the same forward;
    a row's bits do not depend on what it is packed with."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown verify layout {layout!r}")
    inputs = []
    for it in items:
        assert 1 <= it.verify_len <= len(it.drafts) + 1
        if layout == "compact":
            rows = [it.anchor] + it.drafts[:it.verify_len - 1]
        else:
            w = min(width or max(len(i.drafts) + 1 for i in items), engine.cfg.max_seq_len - it.anchor_pos)
            rows = ([it.anchor] + it.drafts + [PAD_TOKEN] * w)[:w]
        inputs.append(SeqInput(it.seq, rows, start=it.anchor_pos, logits="all", leaves=it.leaves))
    out = engine.forward(inputs + list(prefill))
    logits = []
    for i, (it, inp) in enumerate(zip(items, inputs)):
        r = out.rows(i)
        logits.append(torch.cat([r[:it.verify_len], r[len(inp.tokens):]]) if it.leaves else r[:it.verify_len])
    return logits, out.layout.tokens.numel()
