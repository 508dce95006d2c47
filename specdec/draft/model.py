"""A model drafter: any smaller LM on the engine that shares the target's vocabulary, autoregressive, batched across
sessions (one packed forward per draft slot for the whole batch), with its KV rolled back to what was committed.

Layer-skip is this drafter over a subset of the target's own layers (shared weights, own KV cache)."""
from __future__ import annotations

import collections
import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.engine import Engine
from ..engine.layout import SeqInput
from ..engine.model import Transformer
from ..engine.prepack import is_prepacked
from ..engine.quant import QLinear
from ..errors import InvalidRequest, KVPoolExhausted
from ..speculative.accept import Mode, draft_sample
from ..speculative.propose import DraftItem, Drafter, Proposal, SessionTokens
from ..speculative.sampling import probs


def layer_skip(model: Transformer, keep: str | None = None) -> Transformer:
    """The target with only some layers, e.g. keep='0-11,18-29' (default: drop the middle fifth). Weights shared."""
    n = model.cfg.n_layers
    if keep is None:
        lo, hi = int(n * 0.4), int(n * 0.6)
        idx = [i for i in range(n) if not lo <= i < hi]
    else:
        idx = []
        for part in keep.split(","):
            a, _, b = part.partition("-")
            idx += list(range(int(a), int(b or a) + 1))
    if not idx or any(not 0 <= i < n for i in idx):
        raise InvalidRequest(f"{keep!r} does not select layers of a {n}-layer model", field="draft_layers",
                             remedy="use ranges like 0-11,18-29")
    view = copy.copy(model)
    view._modules = dict(model._modules)          # shallow copy must not share the module table
    view.layers = nn.ModuleList(model.layers[i] for i in idx)
    view.cfg = dataclasses.replace(model.cfg, n_layers=len(idx))
    return view


def restrict_vocab(model: Transformer, n: int | None) -> Transformer:
    """The model with an output head over token ids 0..n-1 only (a view; weights shared). BPE vocabularies number
    tokens in merge order, so the first ids are the frequent ones, and a drafter needs only those: the head is the
    largest single weight of a small model with a big vocabulary (Qwen2.5-0.5B: 136M of its 494M parameters). The
    drafter's q is exact over the kept ids and zero elsewhere, so every acceptance mode stays exact; a target token
    outside them is simply never drafted."""
    V = model.cfg.vocab_size
    if not n or n >= V:
        return model
    if n < 1:
        raise InvalidRequest(f"draft_vocab must be positive, not {n}", field="draft_vocab",
                             remedy="use 0 for the whole vocabulary or a count of token ids such as 32768")
    head = model.output_weight
    view = copy.copy(model)
    view._modules = dict(model._modules)
    if isinstance(head, QLinear):
        view.lm_head = head.first_rows(n)       # a QLinear is its own .weight
    else:
        view.lm_head = nn.Linear(model.cfg.dim, n, bias=False, device="meta")
        rows = head.to_dense()[:n].clone() if is_prepacked(head) else head[:n]   # prepacked: no rows to share
        view.lm_head.weight = nn.Parameter(rows, requires_grad=False)
    return view


@dataclasses.dataclass
class _Session:
    seq: int
    cached: list[int]          # tokens whose K/V the drafter holds, in order


class ModelDrafter(Drafter):
    def __init__(self, model: Transformer, *, kv_tokens: int = 16384, name: str = "model", batch_invariant: bool = True,
                 min_conf: float = 0.0):
        # batch_invariant: a session's drafts (hence, in rejection mode, the target's output) do not depend on which
        # other sessions share the draft forward.
        # min_conf: a greedy or coupled request's block ends at the first slot the draft gives less than this
        # probability (that slot kept): each draft slot costs a forward, and one after a likely rejection is wasted.
        # Rejection-sampled requests always get their whole block (their seeded text depends on the blocks).
        self.engine, self.name = Engine(model, kv_tokens=kv_tokens, batch_invariant=batch_invariant), name
        self.min_conf = min_conf
        self.tokens = SessionTokens()
        self.kv: collections.OrderedDict[str, _Session] = collections.OrderedDict()   # LRU order

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def release(self, sid: str) -> None:
        self.tokens.drop(sid)
        s = self.kv.pop(sid, None)
        if s is not None:
            self.engine.release(s.seq)

    def _forward(self, inputs: list[SeqInput], busy: set[str]):
        """Forward, evicting least-recently-used idle sessions' KV when the pool is full (they are rebuilt from
        their committed tokens if they come back)."""
        while True:
            try:
                return self.engine.forward(inputs)
            except KVPoolExhausted:
                idle = next((sid for sid in self.kv if sid not in busy), None)
                if idle is None:
                    raise
                self.engine.release(self.kv.pop(idle).seq)

    def propose(self, items: list[DraftItem]) -> list[Proposal | None]:
        out: list[Proposal | None] = [None] * len(items)      # None: lost, the caller resends with context
        synced = self.tokens.sync_all(items)
        for (k, _, _), prop in zip(synced, self._propose([it for _, _, it in synced])):
            out[k] = prop
        return out

    def _propose(self, items: list[DraftItem]) -> list[Proposal]:
        busy = {it.sid for it in items}
        max_len = self.engine.cfg.max_seq_len
        todo, feeds = [], []
        for it in items:
            toks = self.tokens.tokens[it.sid]
            s = self.kv.get(it.sid)
            if s is None:
                s = self.kv[it.sid] = _Session(self.engine.new_sequence(), [])
            self.kv.move_to_end(it.sid)
            # Keep the cached prefix that still matches; always re-feed at least the anchor (it yields slot 1).
            keep = 0
            for a, b in zip(s.cached, toks[:-1]):
                if a != b:
                    break
                keep += 1
            feeds.append(SeqInput(s.seq, toks[keep:], start=keep))
            gamma = max(0, min(it.gamma, max_len - len(toks)))
            s.cached = toks[:] if gamma > 0 else s.cached[:keep]    # a gamma-0 item is not fed (nothing to draft)
            todo.append((it, s, toks, gamma))
        drafts = {it.sid: ([], [], []) for it, *_ in todo}      # tokens, confidence, q rows
        active = [i for i, (_, _, _, g) in enumerate(todo) if g > 0]
        inputs = [feeds[i] for i in active]
        for j in range(1, max((t[3] for t in todo), default=0) + 1):
            if not inputs:
                break
            out = self._forward(inputs, busy)
            nxt_active, nxt_inputs = [], []
            for r, i in enumerate(active):
                it, s, toks, gamma = todo[i]
                logits = out.rows(r)[-1]
                pos = len(toks) - 1 + j                       # slot j predicts anchor_pos + j
                if it.params.greedy:     # the argmax; no q (greedy acceptance never reads it), so no [V] float64 rows
                    x = int(logits.argmax())
                    conf, q = torch.softmax(logits, -1)[x], None
                else:    # a restricted head (restrict_vocab) drafts over ids 0..len(q)-1: coins for those only
                    q = probs(logits[None], it.params)[0]
                    restricted = len(q) < self.vocab_size
                    head = torch.arange(len(q), device=q.device) if restricted else None   # where q's coins go
                    x = draft_sample(q, it.mode, it.params.seed, pos, ids=head)
                    conf = q[x]
                    if it.mode is Mode.REJECTION and restricted:    # acceptance reads q: zero-padded
                        q = F.pad(q, (0, self.vocab_size - len(q)))
                conf = float(conf)
                t, c, qs = drafts[it.sid]
                t.append(x), c.append(conf), qs.append(q)
                ends = conf < self.min_conf and it.mode is not Mode.REJECTION     # the block ends at this slot
                if j < gamma and not ends:                     # fed for the next slot (never the last one)
                    s.cached.append(x)
                    nxt_active.append(i)
                    nxt_inputs.append(SeqInput(s.seq, [x]))
            active, inputs = nxt_active, nxt_inputs
        props = []
        for it, s, toks, _ in todo:
            t, c, qs = drafts[it.sid]
            q = torch.stack(qs) if qs and not it.params.greedy and it.mode == Mode.REJECTION else None
            props.append(Proposal(anchor=toks[-1], tokens=t, confidence=c, q=q))
        return props
