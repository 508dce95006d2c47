"""Prompt lookup where the context repeats, a model drafter elsewhere: per request and step, the n-gram drafter's
continuation when the last 2 or 3 tokens occurred earlier in the context, else the model's block. More
lookups may follow prompt lookup (`lookups`: NAME+ngram+corpus adds the corpus of the target's own text, corpus.py):
the first that finds a continuation answers, and the model drafts only where none did.

The two win on different text (measured, README "The trained drafter"): copying code from its prompt, n-gram blocks
are long and cheap; on chat they are rarely right and the trained block drafter is better. The model drafter is not
asked where lookup answered (behind a draft server that saves the round trip): when it is next asked, its item carries
every token committed since it last saw the session. Greedy and coupled outputs never depend on the drafts; a
rejection-sampled request's blocks depend only on its own committed tokens, so it replays exactly, whichever drafter
answered. In a target (`--lookup`), lookup runs every step at the full block length, since a copy costs nothing; the
planner's block length (DraftItem.model_gamma, possibly 0) applies to the model's blocks only.
"""
from __future__ import annotations

import dataclasses

from ..speculative.propose import DraftItem, Drafter, Proposal, SessionTokens
from .ngram import LookupDrafter


class HybridDrafter(Drafter):
    looks_up = True

    def __init__(self, model: Drafter, lookups: list[LookupDrafter] | None = None):
        """lookups: tried in order, the first non-empty block wins (default: prompt lookup in the context alone)."""
        from . import lookup_drafter
        self.model = model
        self.lookups = lookups if lookups is not None else [lookup_drafter("ngram")]
        self.sessions = SessionTokens()         # committed tokens per session, which every lookup drafts from
        self.seen: dict[str, int] = {}          # per session: the committed length the model drafter last saw
        self.name = "+".join([model.name] + [lk.name for lk in self.lookups])
        self.feature_layers, self.feature_window = model.feature_layers, model.feature_window

    def __getattr__(self, attr):       # the model drafter's limits, caches and timings (vocab_size, engine, ...)
        if attr == "model":            # not set yet (during unpickling, copy): no recursion
            raise AttributeError(attr)
        return getattr(self.model, attr)

    @property
    def feature_width(self) -> int:
        return self.model.feature_width

    def propose(self, items: list[DraftItem]) -> list[Proposal | None]:
        out: list[Proposal | None] = [None] * len(items)      # None: lost, the caller resends with context
        # (index, (tokens, item)) no lookup answered yet
        left = [(k, (toks, it)) for k, toks, it in self.sessions.sync_all(items)]
        for lk in self.lookups:                                # each lookup answers what the ones before left
            found = []
            for (k, asked), c in zip(left, lk.blocks([a for _, a in left])):
                out[k] = c                                     # the last lookup's empty block where none answers
                if not c.tokens:
                    found.append((k, asked))
            left = found
        sub, ask = [], []
        for k, (toks, it) in left:
            gamma = it.gamma if it.model_gamma is None else min(it.gamma, it.model_gamma)
            if gamma <= 0:                                     # the planner wants no model block
                continue
            seen = min(self.seen.get(it.sid, 0), it.committed_len)
            sub.append(dataclasses.replace(it, new_tokens=toks[seen:it.committed_len], gamma=gamma, model_gamma=None))
            ask.append(k)
        for k, it, answer in zip(ask, sub, self.model.propose(sub) if sub else []):
            out[k] = answer
            if answer is None:
                self.seen.pop(it.sid, None)
            else:
                self.seen[it.sid] = it.committed_len
        return out

    def release(self, sid: str) -> None:
        self.release_all([sid])

    def release_all(self, sids: list[str]) -> None:
        for sid in sids:
            self.seen.pop(sid, None)
            self.sessions.drop(sid)
        for lk in self.lookups:                                # their per-session indexes
            lk.release_all(sids)
        self.model.release_all(sids)                           # a draft server's: one call

    def close(self) -> None:
        getattr(self.model, "close", lambda: None)()
