"""Paged KV cache: one preallocated pool of token slots shared by all sequences.

A sequence owns a list of pages (page_size slots each). Position p of a sequence lives in slot
pages[p // page_size] * page_size + p % page_size, the same slot in every layer. The cache is indexed by position,
so rolling back rejected draft rows is `truncate(seq, n)` followed by writing new rows over the old slots — nothing is
copied. Capacity is checked for the whole batch before anything changes, so exhaustion leaves the pool as it was and
the caller can queue the request (KVPoolExhausted).
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from ..errors import InvalidRequest, KVPoolExhausted


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
        self._seqs: dict[int, _Seq] = {}
        self._ids = itertools.count()

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A new, empty sequence. Pages are taken lazily as it grows."""
        sid = next(self._ids)
        self._seqs[sid] = _Seq()
        return sid

    def free(self, sid: int) -> None:
        self._free.extend(reversed(self._seq(sid).pages))
        del self._seqs[sid]

    def length(self, sid: int) -> int:
        return self._seq(sid).length

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def __contains__(self, sid: int) -> bool:
        return sid in self._seqs

    def _seq(self, sid: int) -> _Seq:
        try:
            return self._seqs[sid]
        except KeyError:
            raise InvalidRequest(f"unknown KV sequence {sid}", field="seq") from None

    def _pages_for(self, n: int) -> int:
        return -(-n // self.page_size)

    # -- growth and rollback ---------------------------------------------------------------------------------------
    def truncate(self, sid: int, n: int) -> None:
        """Roll back to the first n tokens; pages past them go back to the pool."""
        s = self._seq(sid)
        if not 0 <= n <= s.length:
            raise InvalidRequest(f"cannot truncate a sequence of {s.length} tokens to {n}", field="start")
        keep = self._pages_for(n)
        self._free.extend(reversed(s.pages[keep:]))
        del s.pages[keep:]
        s.length = n

    def write(self, spans: list[tuple[int, int, int]]) -> None:
        """Make room for writes: each (sid, start, n) truncates to `start` then extends to start + n.

        All-or-nothing: capacity for the whole list is checked before any sequence changes."""
        need = sum(max(0, self._pages_for(start + n) - len(self._seq(sid).pages)) for sid, start, n in spans)
        for sid, start, n in spans:
            if start > self._seq(sid).length:
                raise InvalidRequest(f"write at position {start} leaves a gap after {self._seq(sid).length} "
                                     "cached tokens", field="start", remedy="append at the cached length or before it")
        if need > len(self._free):
            raise KVPoolExhausted(need, len(self._free), self.page_size)
        for sid, start, n in spans:
            self.truncate(sid, start)
            s = self._seq(sid)
            while len(s.pages) < self._pages_for(start + n):
                s.pages.append(self._free.pop())
            s.length = start + n

    def slots(self, sid: int, start: int, end: int) -> torch.Tensor:
        """Flat slot index of each position in [start, end) of a sequence."""
        s = self._seq(sid)
        pos = torch.arange(start, end)
        pages = torch.tensor(s.pages, dtype=torch.long)
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size
