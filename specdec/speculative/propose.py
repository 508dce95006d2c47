"""The propose step: what a drafter is asked and what it answers (the draft block).

Slot 0 of a block is the anchor — the last committed token, at position anchor_pos = committed_len - 1. Slots
1..gamma hold draft tokens; slot j predicts position anchor_pos + j. Confidences and draft distributions cover the
draft slots only. A drafter may return fewer than gamma tokens (an n-gram drafter with no match returns none).
"""
from __future__ import annotations

import abc
import dataclasses

import torch

from .accept import Mode
from .sampling import SamplingParams


@dataclasses.dataclass
class DraftItem:
    """One running request in a Propose call.

    `new_tokens` are the tokens committed since this session's last call (the whole prompt on the first call);
    `committed_len` is the request's committed length after them. A drafter that lost the session (evicted, restarted)
    rebuilds it from `context` (all committed tokens) when given; otherwise its answer for this item is None and the
    caller resends the item with context."""
    sid: str
    new_tokens: list[int]
    committed_len: int
    gamma: int
    params: SamplingParams = SamplingParams()
    mode: Mode = Mode.GREEDY
    context: list[int] | None = None
    features: torch.Tensor | None = None   # target hidden-state rows of positions features_start.. (feature drafters)
    features_start: int = 0
    model_gamma: int | None = None         # a drafter that looks up first (Drafter.looks_up): its model's block
    #                                        where lookup finds nothing (0: none); None = gamma
    alts: int = 0                          # other likely tokens wanted per slot (Proposal.alts; verify-tree leaves)


@dataclasses.dataclass
class SparseRows:
    """Draft distributions that are zero outside a few ids per slot (top-k/top-p truncation, n-gram one-hots):
    ids [k, m] and probs [k, m], zero-padded."""
    ids: torch.Tensor
    probs: torch.Tensor

    def dense(self, vocab_size: int) -> torch.Tensor:
        out = torch.zeros(self.ids.shape[0], vocab_size, dtype=torch.float64)
        return out.scatter_add_(1, self.ids, self.probs.to(torch.float64))


@dataclasses.dataclass
class Proposal:
    anchor: int
    tokens: list[int]                      # <= gamma draft tokens
    confidence: list[float]                # draft probability of each chosen token
    q: torch.Tensor | SparseRows | None = None  # exact draft distribution per slot (dense [k, V] or sparse);
    #                                             None for greedy requests, whose acceptance does not use it
    copied: bool = False                   # from the context (prompt lookup): no model ran to draft it, so
    #                                        the planner neither charges drafting for it nor mixes its acceptance in
    alts: list[list[tuple[int, float]]] | None = None  # per draft slot, other likely tokens (id, draft
    #                                        probability), best first: leaves of a verify tree (speculative/tree.py)

    def __post_init__(self):
        assert len(self.tokens) == len(self.confidence)

    def q_dense(self, vocab_size: int) -> torch.Tensor:
        return self.q.dense(vocab_size) if isinstance(self.q, SparseRows) else self.q


class SessionLost(Exception):
    """The drafter has no (or a diverged) session and no context to rebuild it from."""

    def __init__(self, sid: str):
        super().__init__(f"draft session {sid} lost; resend with context")
        self.sid = sid


class Drafter(abc.ABC):
    """Proposes draft blocks for many sessions at once and keeps each session in sync with what was committed."""

    name: str = "drafter"
    looks_up: bool = False                 # copies from the context first, at no model cost: asked at full gamma
    #                                        every step, its model part at DraftItem.model_gamma (drafter/hybrid.py)
    feature_layers: tuple[int, ...] = ()   # target layers whose hidden states the drafter reads (over the wire)
    feature_window: int = 0                # committed positions before the anchor it reads

    @property
    def feature_width(self) -> int:
        return 0

    @abc.abstractmethod
    def propose(self, items: list[DraftItem]) -> list[Proposal | None]:
        """One answer per item, in order; None where the session was lost and the item carried no context."""

    @abc.abstractmethod
    def release(self, sid: str) -> None:
        ...

    def release_all(self, sids: list[str]) -> None:
        """release() each session, every one tried whatever another raised (then the first error is raised); a
        drafter behind a server frees them in one call."""
        errors = []
        for sid in sids:
            try:
                self.release(sid)
            except Exception as e:  # noqa: BLE001 - one session's failure must not keep the others' memory
                errors.append(e)
        if errors:
            raise errors[0]


class SessionTokens:
    """Committed tokens per session as a drafter knows them, synchronised from DraftItems."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}

    def sync(self, item: DraftItem) -> list[int]:
        base = item.committed_len - len(item.new_tokens)      # tokens the drafter must already know
        known = self.tokens.get(item.sid, [] if base == 0 else None)
        toks = known[:base] + list(item.new_tokens) if known is not None and len(known) >= base else None
        if item.context is not None and toks != item.context:  # lost or diverged: rebuild from the full context
            toks = list(item.context)
        if toks is None:
            raise SessionLost(item.sid)
        self.tokens[item.sid] = toks
        return toks

    def sync_all(self, items: list[DraftItem]) -> list[tuple[int, list[int], DraftItem]]:
        """(index, committed tokens, item) of each item whose session this drafter knows or can rebuild; a lost one is
        left out (its proposal is None: the caller resends it with context)."""
        synced = []
        for k, it in enumerate(items):
            try:
                synced.append((k, self.sync(it), it))
            except SessionLost:
                pass
        return synced

    def drop(self, sid: str) -> None:
        self.tokens.pop(sid, None)
