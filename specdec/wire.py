"""Conversions between the library's types and the protobuf messages of proto/specdec/v1 (both services use them)."""
from __future__ import annotations

import torch

from .speculative.accept import Mode
from .speculative.propose import DraftItem, Proposal, SparseRows
from .speculative.sampling import SamplingParams
from .v1 import specdec_pb2 as pb

MODE_TO_PB = {Mode.GREEDY: pb.GREEDY, Mode.REJECTION: pb.REJECTION, Mode.COUPLED: pb.COUPLED}
MODE_FROM_PB = {v: k for k, v in MODE_TO_PB.items()}


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
    if p.seed is not None:
        m.seed = p.seed
    return m


def params_from_pb(m: pb.SamplingParams) -> SamplingParams:
    # proto3 sends 0 for an unset top_p: exactly 0 means "off"; anything else (negative, NaN) goes to validation
    return SamplingParams(temperature=m.temperature, top_k=m.top_k, top_p=m.top_p if m.top_p != 0 else 1.0,
                          min_p=m.min_p, seed=m.seed if m.HasField("seed") else None)


def mode_from_pb(v: int, default: Mode | None = None) -> Mode | None:
    return MODE_FROM_PB.get(v, default)


def item_to_pb(it: DraftItem, with_context: bool = False) -> pb.ProposeItem:
    return pb.ProposeItem(request_id=it.sid, new_tokens=it.new_tokens, committed_len=it.committed_len, gamma=it.gamma,
                          sampling=params_to_pb(it.params), mode=MODE_TO_PB[Mode(it.mode)],
                          context=it.context if with_context and it.context is not None else [],
                          features=features_to_bytes(it.features), features_start=it.features_start, alts=it.alts)


def item_from_pb(m: pb.ProposeItem, feature_width: int = 0) -> DraftItem:
    return DraftItem(m.request_id, list(m.new_tokens), m.committed_len, m.gamma, params_from_pb(m.sampling),
                     mode_from_pb(m.mode, Mode.GREEDY), list(m.context) if len(m.context) else None,
                     features_from_bytes(m.features, feature_width), m.features_start, alts=m.alts)


def features_to_bytes(rows: torch.Tensor | None) -> bytes:
    """Hidden-state rows [n, width] -> bfloat16 little-endian bytes (3 layers x 576 = 3,456 bytes a row)."""
    if rows is None or rows.numel() == 0:
        return b""
    return rows.detach().to(torch.bfloat16).contiguous().cpu().view(torch.int16).numpy().astype("<i2").tobytes()


def features_from_bytes(raw: bytes, width: int) -> torch.Tensor | None:
    """The inverse ([n, width] float32); None for no bytes. The caller has checked len(raw) % (2 * width) == 0."""
    if not raw or width <= 0:
        return None
    import numpy as np
    bits = np.frombuffer(raw, dtype="<i2").astype(np.int16)          # a native, writable copy
    return torch.from_numpy(bits).view(torch.bfloat16).float().view(-1, width)


def dists_to_pb(q: torch.Tensor | SparseRows | None) -> list[pb.DraftDistribution]:
    if q is None:
        return []
    if isinstance(q, SparseRows):
        out = []
        for ids, probs in zip(q.ids.tolist(), q.probs.tolist()):
            nz = [(i, p) for i, p in zip(ids, probs) if p > 0]
            out.append(pb.DraftDistribution(ids=[i for i, _ in nz], probs=[p for _, p in nz]))
        return out
    out = []
    for row in q:
        ids = row.nonzero().flatten()
        if ids.numel() * 3 < row.numel():        # sparse pays off: ids (4 B) + probs (8 B) vs 8 B per entry
            out.append(pb.DraftDistribution(ids=ids.tolist(), probs=row[ids].tolist()))
        else:
            out.append(pb.DraftDistribution(probs=row.tolist()))
    return out


def dists_from_pb(ds, vocab_size: int) -> torch.Tensor | None:
    """Dense float64 [k, V]; exact (float64 on the wire)."""
    if not len(ds):
        return None
    q = torch.zeros(len(ds), vocab_size, dtype=torch.float64)
    for j, d in enumerate(ds):
        if len(d.ids):
            q[j, torch.tensor(list(d.ids))] = torch.tensor(list(d.probs), dtype=torch.float64)
        else:
            q[j] = torch.tensor(list(d.probs), dtype=torch.float64)
    return q


def proposal_to_pb(p: Proposal) -> pb.Proposal:
    alts = p.alts or []
    return pb.Proposal(status=pb.Proposal.OK, anchor=p.anchor, tokens=p.tokens, confidence=p.confidence,
                       q=dists_to_pb(p.q), copied=p.copied, alt_counts=[len(a) for a in alts],
                       alt_tokens=[x for a in alts for x, _ in a], alt_probs=[pr for a in alts for _, pr in a])


def proposal_from_pb(m: pb.Proposal, vocab_size: int) -> Proposal:
    alts, k = [], 0
    for n in m.alt_counts:
        alts.append(list(zip(m.alt_tokens[k:k + n], m.alt_probs[k:k + n])))
        k += n
    return Proposal(anchor=m.anchor, tokens=list(m.tokens), confidence=list(m.confidence),
                    q=dists_from_pb(m.q, vocab_size), copied=m.copied, alts=alts or None)
