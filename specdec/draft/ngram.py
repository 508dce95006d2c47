"""Prompt-lookup drafting: propose the continuation of the latest earlier occurrence of the last n tokens.

Costs almost nothing and does well wherever text repeats its context (code, edits, quoting). Its draft
distribution is one-hot on the proposed token, which rejection sampling handles exactly (accept w.p. p(x))."""
from __future__ import annotations

import torch

from ..speculative.propose import DraftItem, Drafter, Proposal, SessionLost, SessionTokens, SparseRows


def lookup(tokens: list[int], gamma: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Continuation (<= gamma tokens) after the latest earlier match of the longest suffix n-gram, n = max_n..min_n."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):          # latest match first; it must end before the tail
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + gamma]
    return []


class NgramDrafter(Drafter):
    name = "ngram"
    looks_up = True

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n, self.sessions = max_n, min_n, SessionTokens()

    def propose(self, items: list[DraftItem]) -> list[Proposal | None]:
        out = []
        for it in items:
            try:
                toks = self.sessions.sync(it)
            except SessionLost:
                out.append(None)
                continue
            cont = lookup(toks, it.gamma, self.max_n, self.min_n)
            q = None if it.params.greedy else SparseRows(torch.tensor(cont, dtype=torch.long).reshape(-1, 1),
                                                         torch.ones(len(cont), 1, dtype=torch.float64))
            out.append(Proposal(anchor=toks[-1], tokens=cont, confidence=[1.0] * len(cont), q=q, copied=True))
        return out

    def release(self, sid: str) -> None:
        self.sessions.drop(sid)
