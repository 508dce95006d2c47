"""Paged KV cache: one preallocated pool of token slots shared by all sequences.

A sequence owns a list of pages (page_size slots each). Position p of a sequence lives in slot
pages[p // page_size] * page_size + p % page_size, the same slot in every layer. The cache is indexed by position,
so rolling back rejected draft rows is `truncate(seq, n)` followed by writing new rows over the old slots — nothing is
copied. Capacity is checked for the whole batch before anything changes, so exhaustion leaves the pool as it was and
the caller can queue the request (KVPoolExhausted).

Prefix cache: full pages of a prompt stay behind, keyed by their tokens and the page before them, for the next prompt
that begins the same way (chat requests share a system prompt). `match_prefix` hands a new sequence the cached pages
its tokens begin with, and then the cached page that shares the longest start with the rest of them (a system prompt
rarely ends on a page boundary: its tail shares a page with the first user turn); `remember` offers a sequence's full
pages (the engine offers a prompt's after its prefill, and a released sequence's: a chat's next turn begins with the
last one). A page counts its holders (sequences and the cache); one only the cache holds is free for the asking
(`free_tokens` counts it) and is evicted least recently used first when a write needs room. A write into a shared
page copies it first. Reusing K/V is exact where the engine is batch-invariant: a position's K/V are a function of the
tokens up to it, whatever forward computed them.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence

import torch

from ..errors import InvalidRequest, KVPoolExhausted


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two runs share."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclasses.dataclass
class _Seq:
    pages: list[int] = dataclasses.field(default_factory=list)
    length: int = 0                      # tokens whose K/V are valid


class KVPool:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_tokens: int, *, page_size: int = 16,
                 dtype=torch.bfloat16, device="cpu"):
        self.page_size = page_size
        self.num_pages = max(1, -(-num_tokens // page_size))
        shape = (n_layers, self.num_pages * page_size, n_kv_heads, head_dim)
        # empty, not zeros: untouched pages cost no resident memory, and no slot is read before it is written.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: recently freed pages are reused first
        self._holders = [0] * self.num_pages                   # sequences holding each page, + 1 if the cache does
        self._in_cache = [False] * self.num_pages
        self._cache_only = 0                                   # cached pages no sequence holds (free for the asking)
        self._seqs: dict[int, _Seq] = {}
        self._ids = itertools.count()
        # prefix cache: (parent node, the page's tokens) -> (node, page); least recently used first. Node ids are never
        # reused, so a page whose parent was evicted can no longer be reached, and it is evicted in its turn.
        self._cached: collections.OrderedDict[tuple, tuple[int, int]] = collections.OrderedDict()
        self._children: dict[int, set[tuple]] = collections.defaultdict(set)   # parent node -> its keys
        self._nodes = itertools.count(1)

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A new, empty sequence. Pages are taken lazily as it grows."""
        sid = next(self._ids)
        self._seqs[sid] = _Seq()
        return sid

    def free(self, sid: int) -> None:
        self._drop(reversed(self._seq(sid).pages))
        del self._seqs[sid]

    def length(self, sid: int) -> int:
        return self._seq(sid).length

    @property
    def free_tokens(self) -> int:
        return (len(self._free) + self._cache_only) * self.page_size

    @property
    def cached_pages(self) -> int:
        return len(self._cached)

    def __contains__(self, sid: int) -> bool:
        return sid in self._seqs

    def _seq(self, sid: int) -> _Seq:
        try:
            return self._seqs[sid]
        except KeyError:
            raise InvalidRequest(f"unknown KV sequence {sid}", field="seq") from None

    def _pages_for(self, n: int) -> int:
        return -(-n // self.page_size)

    def _take(self) -> int:
        page = self._free.pop()
        self._holders[page] = 1
        return page

    def _hold(self, page: int, d: int) -> None:
        """One holder more (d = 1) or fewer (-1); counts the cached pages only the cache holds as it goes."""
        before = self._holders[page]
        self._holders[page] = before + d
        if self._in_cache[page]:
            self._cache_only += (before + d == 1) - (before == 1)
        if not self._holders[page]:
            self._free.append(page)

    def _drop(self, pages) -> None:
        for page in pages:
            self._hold(page, -1)

    def _cache(self, page: int) -> None:
        self._hold(page, 1)
        self._in_cache[page] = True

    def _uncache(self, page: int) -> None:
        self._cache_only -= self._holders[page] == 1
        self._in_cache[page] = False
        self._hold(page, -1)

    def _evict(self, n: int) -> None:
        """Give back up to n pages that only the cache holds, least recently used first."""
        only_cached = (k for k, (_, page) in self._cached.items() if self._holders[page] == 1)
        for key in list(itertools.islice(only_cached, n)):      # from the least recent, no further than the n-th
            if key in self._cached:             # not already gone below an evicted page
                self._forget(key)

    def _forget(self, key: tuple) -> None:
        """Uncache a key and every key below it. A page a sequence still holds stays cached after its parent is
        evicted, but no prefix reaches it any more, and a later remember() of the same text cached that page a second
        time, under a new parent: the cache then held it twice, and freeing everything left a page unaccounted for
        (found by test_pool_against_its_model)."""
        todo = [key]
        while todo:
            k = todo.pop()
            node, page = self._cached.pop(k)
            self._uncache(page)
            siblings = self._children[k[0]]
            siblings.discard(k)
            if not siblings:                    # node ids are never reused: no empty entries left behind
                del self._children[k[0]]
            todo.extend(self._children.get(node, ()))

    # -- prefix cache ----------------------------------------------------------------------------------------------
    def clear_cache(self) -> None:
        """Forget every cached prefix (pages only the cache held go back to the pool): the next prompts run cold."""
        for _, page in self._cached.values():
            self._uncache(page)
        self._cached.clear()
        self._children.clear()

    def holds_first_page(self, tokens) -> bool:
        """Whether the cache holds a first page of these page_size tokens."""
        return (0, tuple(tokens)) in self._cached

    def match_prefix(self, sid: int, tokens) -> int:
        """An empty sequence takes the cached pages that `tokens` begin with, whole pages first, then the one page
        whose start agrees longest with the rest (shared: the sequence's first write into it copies it); returns how
        many positions the sequence now has."""
        s, ps = self._seq(sid), self.page_size
        if s.length:
            raise InvalidRequest("a prefix is matched only by an empty sequence", field="seq")
        tokens = list(tokens)
        parent, keys, n = 0, [], 0
        while n < len(tokens):
            rest = tuple(tokens[n:n + ps])
            key = (parent, rest)
            if len(rest) == ps and key in self._cached:
                t = ps
            else:                       # the child page agreeing longest with the rest, if any agrees at all
                t, key = max(((common_prefix(k[1], rest), k) for k in self._children.get(parent, ())),
                             default=(0, None))
                if not t:
                    break
            parent, page = self._cached[key]
            keys.append(key)
            s.pages.append(page)
            self._hold(page, 1)
            n += t
            if t < ps:
                break
        for key in reversed(keys):      # a page's parent more recent than it: evicted after it
            self._cached.move_to_end(key)
        s.length = n
        return n

    def remember(self, sid: int, tokens) -> None:
        """Offer the sequence's full pages that hold `tokens` (its positions from 0) to the cache. Pages whose tokens
        are cached already (in another page) stay the sequence's own."""
        s, ps, parent = self._seq(sid), self.page_size, 0
        for i in range(min(len(tokens), s.length) // ps):
            key = (parent, tuple(tokens[i * ps:(i + 1) * ps]))
            if key not in self._cached:
                self._cached[key] = (next(self._nodes), s.pages[i])
                self._children[parent].add(key)
                self._cache(s.pages[i])
            parent = self._cached[key][0]

    # -- growth and rollback ---------------------------------------------------------------------------------------
    def truncate(self, sid: int, n: int) -> None:
        """Roll back to the first n tokens; pages past them go back to the pool."""
        s = self._seq(sid)
        if not 0 <= n <= s.length:
            raise InvalidRequest(f"cannot truncate a sequence of {s.length} tokens to {n}", field="start")
        keep = self._pages_for(n)
        self._drop(reversed(s.pages[keep:]))
        del s.pages[keep:]
        s.length = n

    def copy(self, sid: int, src: int, dst: int) -> None:
        """Every layer's K/V of position src into position dst's slot (a verify tree's accepted leaf takes the
        place of the chain row it stood in for)."""
        i, j = (int(self.slots(sid, p, p + 1)) for p in (src, dst))
        for t in (self.k, self.v):
            t[:, j] = t[:, i]

    def write(self, spans: list[tuple[int, int, int]]) -> None:
        """Make room for writes: each (sid, start, n) truncates to `start` then extends to start + n.

        All-or-nothing: capacity for the whole list is checked before any sequence changes (pages only the prefix
        cache holds are evicted to make room)."""
        for sid, start, n in spans:
            if start > self._seq(sid).length:
                raise InvalidRequest(f"write at position {start} leaves a gap after {self._seq(sid).length} "
                                     "cached tokens", field="start", remedy="append at the cached length or before it")
        need = sum(self._need(sid, start, n) for sid, start, n in spans)
        if need > len(self._free):
            self._evict(need - len(self._free))
        if need > len(self._free):
            raise KVPoolExhausted(need, len(self._free), self.page_size)
        for sid, start, n in spans:
            self.truncate(sid, start)
            s = self._seq(sid)
            if self._shared_at(sid, start):          # copy on write: the page others hold stays as it is
                old, new, r, ps = s.pages[-1], self._take(), start % self.page_size, self.page_size
                for t in (self.k, self.v):
                    t[:, new * ps:new * ps + r] = t[:, old * ps:old * ps + r]
                self._drop([old])
                s.pages[-1] = new
            while len(s.pages) < self._pages_for(start + n):
                s.pages.append(self._take())
            s.length = start + n

    def _need(self, sid: int, start: int, n: int) -> int:
        """Pages a write takes from the pool: new pages (one more to copy a shared page into), less the pages its
        truncation gives back (a page someone else holds stays theirs)."""
        s, keep = self._seq(sid), self._pages_for(start)
        back = sum(self._holders[page] == 1 for page in s.pages[keep:])
        return max(0, self._pages_for(start + n) - keep + self._shared_at(sid, start) - back)

    def _shared_at(self, sid: int, start: int) -> int:
        """1 if a write from `start` would land in a page someone else holds too (start inside a kept page)."""
        s = self._seq(sid)
        i = start // self.page_size
        return int(start % self.page_size != 0 and i < len(s.pages) and self._holders[s.pages[i]] > 1)

    def slots(self, sid: int, start: int, end: int) -> torch.Tensor:
        """Flat slot index of each position in [start, end) of a sequence."""
        s = self._seq(sid)
        pos = torch.arange(start, end)
        pages = torch.tensor(s.pages, dtype=torch.long)
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size
