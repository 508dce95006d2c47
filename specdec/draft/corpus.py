"""Drafting from the target's own past text: a variable-order n-gram index over a corpus of its generations.

Lookup in the context (ngram.py) copies what this request already said; this copies what the target said in *other*
documents after the same few tokens -- code idioms, chat phrasing, the template's turn endings. The corpus is the
data `make train-drafter` generates (the target's greedy and T=0.7 answers to the training prompts; never the
evaluation prompts), shipped beside the block drafter's checkpoint as token ids.

The index: for each order n in [min_n, max_n], every corpus position's preceding n tokens (within its document) are
hashed, and each distinct context keeps the token that followed it most often, that count and the context's total.
A draft extends the context token by token from the longest context the corpus holds, with confidence
count / (total + 1): the corpus frequency, shrunk so that a context seen once says 0.5 rather than prompt lookup's
1.0 (copied blocks share one calibration in the planner, binned by confidence, and learned online there). It is
static: a request's blocks depend on its committed tokens alone, so rejection-sampled requests replay exactly, as
with prompt lookup. The draft distribution is one-hot on the drafted token, as for prompt lookup.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .ngram import LookupDrafter

_MUL = 0x9E3779B97F4A7C15      # odd 64-bit multiplier: a context's hash is a polynomial in it, nearest token first
_MASK = (1 << 64) - 1
BLOCK = 64                     # keys per block of the two-level search (512 bytes: 8 cache lines)


class Corpus:
    """The index (see the module doc). tokens: the corpus, documents concatenated; doc_len: each document's length.

    Every order's contexts share one sorted table of 64-bit hashes (a context of n tokens hashes to a polynomial of
    degree n - 1, so orders do not mix but by a 2^-64 chance; a collision could only make a draft wrong, never an
    output): one searchsorted finds every order of a query at once."""

    def __init__(self, tokens, doc_len, *, max_n: int = 6, min_n: int = 2):
        t = np.asarray(tokens, dtype=np.int64)
        doc_len = np.asarray(doc_len, dtype=np.int64)
        if t.size != doc_len.sum():
            raise ValueError(f"corpus holds {t.size} tokens but its documents add up to {doc_len.sum()}")
        self.min_n, self.max_n, self.n_tokens = min_n, max_n, int(t.size)
        doc_start = np.repeat(np.cumsum(doc_len) - doc_len, doc_len)
        pos = np.arange(t.size)
        code = t.astype(np.uint64) + np.uint64(1)
        h = np.zeros(t.size, dtype=np.uint64)
        hashes, nexts = [], []
        with np.errstate(over="ignore"):
            for n in range(1, max_n + 1):
                prev = np.zeros(t.size, dtype=np.uint64)          # the token n back from each position
                prev[n:] = code[:-n]
                h = h * np.uint64(_MUL) + prev                    # hash of tokens pos-n .. pos-1, nearest first
                if n >= min_n:
                    ok = pos - n >= doc_start                     # the whole context inside the document
                    hashes.append(h[ok])
                    nexts.append(t[ok])
        # sorted context hashes, and each context's most frequent next token, its count, the context's total
        self.keys, self.nxt, self.count, self.total = _best_next(np.concatenate(hashes), np.concatenate(nexts))
        # a two-level search: every BLOCK-th key (a table that stays in cache), then one block of keys read in a row.
        # A binary search of the whole table (the shipped corpus: 2.1M keys, 17 MB) took ~0.9 us a hash out of
        # cache, this ~0.55 (85 hashes a call); a step's drafts at 32 requests 0.79 ms against 1.04
        pad = -self.keys.size % BLOCK
        self.blocks = np.concatenate([self.keys, np.full(pad, np.iinfo(np.uint64).max, np.uint64)]).reshape(-1, BLOCK)
        self.keys, self.top = self.blocks.reshape(-1)[:self.keys.size], self.blocks[:, 0].copy()   # keys: a view

    def find(self, hs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index, found) of each hash in the table (`keys`); the index is meaningful only where found."""
        b = np.maximum(np.searchsorted(self.top, hs, side="right") - 1, 0)
        idx = np.minimum(b * BLOCK + (self.blocks[b] < hs[:, None]).sum(1), self.keys.size - 1)
        return idx, self.keys[idx] == hs

    def _hashes(self, ctx: list[int]) -> list[int]:
        """The hashes of ctx's last min_n .. max_n tokens (as many as it has), shortest first."""
        out, h = [], 0
        for n, x in enumerate(reversed(ctx[-self.max_n:]), 1):
            h = (h * _MUL + x + 1) & _MASK
            if n >= self.min_n:
                out.append(h)
        return out

    def next(self, ctx: list[int]) -> tuple[int, int, int] | None:
        """The token that most often followed the longest suffix of ctx the corpus holds (>= min_n): (token, its
        count, the context's total)."""
        hs = np.array(self._hashes(ctx), dtype=np.uint64)
        if hs.size == 0 or self.keys.size == 0:
            return None
        idx = np.minimum(np.searchsorted(self.keys, hs), self.keys.size - 1)
        hit = np.flatnonzero(self.keys[idx] == hs)
        if hit.size == 0:
            return None
        i = idx[hit[-1]]                                          # the longest order that matched
        return int(self.nxt[i]), int(self.count[i]), int(self.total[i])

    def next_ref(self, ctx: list[int], docs: list[list[int]]) -> tuple[int, float] | None:
        """`next` by scanning the documents (slow; the reference the index is tested against)."""
        for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
            counts: dict[int, int] = {}
            for d in docs:
                for i in range(n, len(d)):
                    if d[i - n:i] == list(ctx[-n:]):
                        counts[d[i]] = counts.get(d[i], 0) + 1
            if counts:
                best = min(counts, key=lambda x: (-counts[x], x))
                return best, counts[best], sum(counts.values())
        return None

    def draft(self, ctx: list[int], gamma: int, min_conf: float = 0.0) -> tuple[list[int], list[float]]:
        """Up to gamma tokens extending ctx, each from the longest matching context; stops where none matches or the
        confidence (count / (total + 1)) falls below min_conf. One token at a time through `next`: the reference
        `drafts` is tested against."""
        ctx, out, conf = list(ctx[-self.max_n:]), [], []      # next() reads the last max_n tokens only
        for _ in range(gamma):
            r = self.next(ctx)
            if r is None or r[1] / (r[2] + 1) < min_conf:
                break
            out.append(r[0])
            conf.append(r[1] / (r[2] + 1))
            ctx.append(r[0])
        return out, conf

    def drafts(self, ctxs: list[list[int]], gamma: int, min_conf: float = 0.0) -> list[tuple[list[int], list[float]]]:
        """`draft` of every context at once: one `find` a slot for every context and order (`next` per request and
        slot, a binary search of the whole table each, took ~1.2 ms of a served step at 32 requests)."""
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in ctxs]
        live = [(list(c[-self.max_n:]), o) for c, o in zip(ctxs, out)]   # next() reads the last max_n tokens only
        for _ in range(gamma):
            if not live or self.keys.size == 0:
                break
            hashes = [self._hashes(c) for c, _ in live]
            idx, hit = self.find(np.array([h for hs in hashes for h in hs], dtype=np.uint64))
            idx, hit = idx.tolist(), hit.tolist()
            keep, k = [], 0
            for (c, (toks, conf)), hs in zip(live, hashes):
                i = next((idx[j] for j in range(k + len(hs) - 1, k - 1, -1) if hit[j]), None)   # the longest order
                k += len(hs)
                c_i = None if i is None else int(self.count[i]) / (int(self.total[i]) + 1)
                if c_i is None or c_i < min_conf:
                    continue
                toks.append(int(self.nxt[i]))
                conf.append(c_i)
                c.append(toks[-1])
                del c[:-self.max_n]
                keep.append((c, (toks, conf)))
            live = keep
        return out

    @classmethod
    def load(cls, path: str | Path, **kw) -> "Corpus":
        tokens, doc_len = read_corpus(path)
        return cls(tokens.numpy(), doc_len.numpy(), **kw)


def save_corpus(path: str | Path, tokens, doc_len) -> None:
    """Token ids (uint16 where every id fits: SmolLM2's 49,152 do, 2 bytes a token) and document lengths."""
    from safetensors.torch import save_file
    t = torch.as_tensor(np.asarray(tokens)).to(torch.int64)
    t = t.to(torch.uint16) if t.numel() == 0 or int(t.max()) < 1 << 16 else t.to(torch.int32)
    save_file({"tokens": t.contiguous(), "doc_len": torch.as_tensor(np.asarray(doc_len), dtype=torch.int64)}, str(path))


def read_corpus(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """What save_corpus wrote: the token ids (int64) and the document lengths."""
    from safetensors.torch import load_file
    d = load_file(str(path))
    return d["tokens"].to(torch.int64), d["doc_len"]


def _best_next(h: np.ndarray, nxt: np.ndarray):
    """Per distinct hash (sorted): the most frequent next token (the smallest id on a tie), its count, the total."""
    if h.size == 0:
        return h, nxt.astype(np.int32), nxt.astype(np.int32), nxt.astype(np.int32)
    order = np.lexsort((nxt, h))
    h, nxt = h[order], nxt[order]
    run = np.flatnonzero(np.r_[True, (h[1:] != h[:-1]) | (nxt[1:] != nxt[:-1])])   # distinct (hash, next) pairs
    cnt = np.diff(np.r_[run, h.size])
    rh, rn = h[run], nxt[run]
    group = np.cumsum(np.r_[True, rh[1:] != rh[:-1]]) - 1
    total = np.bincount(group, weights=cnt).astype(np.int32)
    by_count = np.lexsort((rn, -cnt, group))           # within a group: highest count first, then smallest id
    first = by_count[np.r_[True, group[by_count][1:] != group[by_count][:-1]]]
    return rh[first], rn[first].astype(np.int32), cnt[first].astype(np.int32), total


class CorpusDrafter(LookupDrafter):
    """Drafts from a Corpus; a looking-up drafter like prompt lookup (no model runs: `copied` blocks)."""

    name = "corpus"

    def __init__(self, corpus: Corpus, min_conf: float = 0.0):
        super().__init__()
        self.corpus, self.min_conf = corpus, min_conf

    def continuation(self, toks: list[int], gamma: int, sid: str) -> tuple[list[int], list[float]]:
        return self.corpus.drafts([toks], gamma, self.min_conf)[0]

    def continuations(self, asked) -> list[tuple[list[int], list[float]]]:
        by_gamma: dict[int, list[int]] = {}                   # one batch per block length (one in practice)
        for k, (_, it) in enumerate(asked):
            by_gamma.setdefault(it.gamma, []).append(k)
        out: list = [None] * len(asked)
        for gamma, ks in by_gamma.items():
            for k, d in zip(ks, self.corpus.drafts([asked[k][0] for k in ks], gamma, self.min_conf)):
                out[k] = d
        return out
