"""Prompt lookup where the context repeats, a model drafter elsewhere: per request and step, the n-gram drafter's
continuation when the last `min_match` or more tokens occurred earlier in the context, else the model's block.

The two win on different text (measured, README "The trained drafter"): copying code from its prompt, n-gram blocks
are long and cheap; on chat they are rarely right and the trained block drafter is better. The model drafter still
sees every item (its sessions and feature caches stay in sync) but drafts none where lookup answered: those items
reach it with gamma 0. Greedy and coupled outputs never depend on the drafts; a rejection-sampled request's blocks
depend only on its own committed tokens, so it replays exactly, whichever drafter answered.
"""
from __future__ import annotations

import dataclasses

from ..speculative.propose import DraftItem, Drafter, Proposal
from .ngram import NgramDrafter


class HybridDrafter(Drafter):
    def __init__(self, model: Drafter, min_match: int = 2, max_match: int = 3):
        self.model = model
        self.lookup = NgramDrafter(max_n=max(min_match, max_match), min_n=min_match)
        self.name = f"{model.name}+ngram"
        self.feature_layers, self.feature_window = model.feature_layers, model.feature_window

    def __getattr__(self, attr):       # the model drafter's limits, caches and timings (vocab_size, engine, ...)
        if attr == "model":            # not set yet (during unpickling, copy): no recursion
            raise AttributeError(attr)
        return getattr(self.model, attr)

    @property
    def feature_width(self) -> int:
        return self.model.feature_width

    def propose(self, items: list[DraftItem]) -> list[Proposal | None]:
        copies = self.lookup.propose(items)
        answers = self.model.propose([dataclasses.replace(it, gamma=0) if c is not None and c.tokens else it
                                      for it, c in zip(items, copies)])
        # a lost session on either side: None, so the caller resends the item with its context
        return [None if c is None or a is None else c if c.tokens else a for c, a in zip(copies, answers)]

    def release(self, sid: str) -> None:
        self.lookup.release(sid)
        self.model.release(sid)

    def close(self) -> None:
        getattr(self.model, "close", lambda: None)()
