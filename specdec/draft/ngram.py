"""Prompt-lookup drafting: propose the continuation of the latest earlier occurrence of the last n tokens.

Costs almost nothing and does well wherever text repeats its context (code, edits, quoting). Its draft
distribution is one-hot on the proposed token, which rejection sampling handles exactly (accept w.p. p(x))."""
from __future__ import annotations

import abc

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


class LookupDrafter(Drafter):
    """A drafter that copies rather than runs a model (prompt lookup, the corpus): `block` drafts from a session's
    committed tokens; blocks are `copied`, with a one-hot draft distribution."""

    looks_up = True

    def __init__(self):
        self.sessions = SessionTokens()

    @abc.abstractmethod
    def continuation(self, toks: list[int], gamma: int) -> tuple[list[int], list[float]]:
        """Up to gamma tokens continuing toks, and a confidence for each."""

    def block(self, toks: list[int], it: DraftItem) -> Proposal:
        cont, conf = self.continuation(toks, it.gamma)
        q = None if it.params.greedy else SparseRows(torch.tensor(cont, dtype=torch.long).reshape(-1, 1),
                                                     torch.ones(len(cont), 1, dtype=torch.float64))
        return Proposal(anchor=toks[-1], tokens=cont, confidence=conf, q=q, copied=True)

    def propose(self, items: list[DraftItem]) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for it in items:
            try:
                out.append(self.block(self.sessions.sync(it), it))
            except SessionLost:
                out.append(None)
        return out

    def release(self, sid: str) -> None:
        self.sessions.drop(sid)


class NgramDrafter(LookupDrafter):
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        super().__init__()
        self.max_n, self.min_n = max_n, min_n

    def continuation(self, toks: list[int], gamma: int) -> tuple[list[int], list[float]]:
        cont = lookup(toks, gamma, self.max_n, self.min_n)
        return cont, [1.0] * len(cont)
