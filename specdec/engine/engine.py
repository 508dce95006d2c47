"""The engine: a model, its KV pool, and the packed ragged forward over many sequences (the embedded
implementation of engine.backend.Backend).

    eng = Engine(model, kv_tokens=8192)
    a, b = eng.new_sequence(), eng.new_sequence()
    out = eng.forward([SeqInput(a, prompt_a), SeqInput(b, block_b, start=n_b, logits="all")])
    out.rows(1)   # logits of every new row of b (a verify)

Prefill, decode and verify are all `forward`: they differ only in how many rows each sequence brings and which
logits come back.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.nn.functional as F

from ..errors import InvalidRequest
from .attention import acc_dtype, plan_groups
from .kv_cache import KVPool, common_prefix
from .layout import Layout, SeqInput, pack
from .model import Transformer, post_attention, pre_attention
from . import prepack
from .quant import QLinear
from .row_tiles import probe_row_tiles

SHARE_MIN_ROWS = 64     # rows a prefill's later prompts must skip to be worth a forward of their own (Engine.prefill)


def _ints(tokens) -> list[int]:
    """Token ids as a list, from a list or a tensor of any shape."""
    return tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else list(tokens)


@dataclasses.dataclass
class ForwardOutput:
    logits: torch.Tensor            # [R, V], float32 (float64 for float64 models)
    cu_logits: list[int]
    hidden: dict[int, torch.Tensor]  # layer -> [T, dim] hidden states of every packed row
    layout: Layout

    def rows(self, i: int) -> torch.Tensor:
        """Logits returned for input i."""
        return self.logits[self.cu_logits[i]:self.cu_logits[i + 1]]


class PagedSequences:
    """The Backend's sequence bookkeeping over a KVPool `self.kv` (and `self.cfg`), shared by Engine and TPEngine (whose
    rank 0 keeps the pages of all ranks)."""
    cfg: object
    kv: KVPool

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def new_sequence(self) -> int:
        return self.kv.allocate()

    def release(self, seq: int) -> None:
        self.kv.free(seq)

    def length(self, seq: int) -> int:
        return self.kv.length(seq)

    def truncate(self, seq: int, n: int) -> None:
        self.kv.truncate(seq, n)

    verify_leaves = False      # forward() runs verify trees' leaf rows (SeqInput.leaves) and keep_leaf() adopts one

    def keep_leaf(self, seq: int, src: int, dst: int, token: int) -> None:
        raise NotImplementedError("this backend runs no verify trees")

    def has_sequence(self, seq: int) -> bool:
        return seq in self.kv

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv.num_pages * self.kv.page_size

    @property
    def kv_free_tokens(self) -> int:
        return self.kv.free_tokens

    @property
    def kv_page_size(self) -> int:
        return self.kv.page_size


class Engine(PagedSequences):
    """`batch_invariant` (default on): the logits of a row and the KV it writes are bitwise the same whatever else
    is in the forward (row count, other sequences, layout, chunk size, verify vs decode), so a request's output never
    depends on its neighbours. Attention runs on fixed key blocks and query tiles (engine/attention.py); linears run
    on the window of row counts where a start-up probe finds the BLAS row-invariant (engine/row_tiles.py).
    Off: one SDPA call per sequence, a little faster, and a row may round differently in a pack than alone.

    `compile_tiers`: row counts T for which uniform layouts (every sequence brings the same number of rows) run
    the dense block kernels compiled (torch.compile, one fixed-shape graph per tier, shared by all layers); ragged
    layouts and other row counts run eager. The CPU twin of CUDA-graph capture on fixed batch tiers. A compiled graph
    rounds differently from the eager kernels, so tiers need batch_invariant=False.

    `prefix_cache` (default: on where batch-invariant): a prefill of an empty sequence skips the full pages of its
    prompt that an earlier prompt began with (kv_cache.py), bitwise the same K/V and logits as running them."""

    def __init__(self, model: Transformer, *, kv_tokens: int = 8192, page_size: int = 16,
                 compile_tiers: tuple[int, ...] = (), batch_invariant: bool = True, prefix_cache: bool | None = None):
        if compile_tiers and any(isinstance(m, QLinear) for m in model.modules()):
            raise InvalidRequest("compiled tiers are not implemented for quantized models", field="compile_tiers",
                                 remedy="drop compile tiers or use --quant none")
        if batch_invariant and compile_tiers:
            raise InvalidRequest("compiled tiers round differently from eager kernels", field="compile_tiers",
                                 remedy="pass batch_invariant=False to use compile tiers")
        self.model = model.eval()
        self.batch_invariant = batch_invariant
        self.compile_tiers = frozenset(compile_tiers)
        self._compiled = None
        self._eager = None
        self.row_tiles = None       # the linears' row window (batch-invariant engines): the planner profiles its edges
        if not compile_tiers:       # bf16 weights prepacked for oneDNN where the bits stay F.linear's (prepack.py)
            prepack.prepack_linears(model, prepack.BOUNDED_ROWS if batch_invariant else prepack.UNBOUNDED)
        if batch_invariant:   # linears on the row counts where this BLAS gives a row the same bits (row_tiles.py)
            L = model.layers[0]
            weights = [L.attn.wqkv.weight, L.attn.wo.weight, L.mlp.w_gate_up.weight, L.mlp.w_down.weight,
                       model.output_weight]
            self.row_tiles = tiles = probe_row_tiles(weights)      # within the rows packed weights agreed on
            self._eager = (functools.partial(pre_attention, linear=tiles),
                           functools.partial(post_attention, linear=tiles), tiles)
        self.path_counts = {"compiled": 0, "eager": 0}
        self.cfg = model.cfg
        self.heads_per_kv = model.cfg.n_heads // model.cfg.n_kv_heads   # of this model's (shard's) own heads
        self.dtype = model.embed.weight.dtype
        self.device = model.embed.weight.device
        # The invariant attention computes in float32 for bf16/fp16 models: keys/values are stored there (exactly, a
        # widening cast) so each layer gathers them without a cast pass per forward (the cast of every cached key and
        # value was most of a batch-64 decode step), at twice the KV bytes.
        self.kv = KVPool(self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.hd, kv_tokens, page_size=page_size,
                         dtype=acc_dtype(self.dtype) if batch_invariant else self.dtype, device=self.device)
        self.rows_processed = 0      # packed rows through the model so far (what compact verify saves)
        # exact only where a position's K/V do not depend on the forward that computed them (batch-invariant
        # engines); SPECDEC_PREFIX_CACHE=0 turns it off, to measure what it saves
        self.prefix_cache = (batch_invariant and not compile_tiers if prefix_cache is None else prefix_cache) \
            and os.environ.get("SPECDEC_PREFIX_CACHE", "1") != "0"
        # with the cache: each sequence's tokens whose K/V its pages hold, so that a released sequence leaves its full
        # pages behind (a chat's next turn begins with this turn's prompt and answer)
        self._written: dict[int, list[int]] = {}
        self.prefix_queries = self.prefix_hits = 0     # prompt tokens looked up in the cache, and found (metrics)

    def healthy(self) -> bool:
        return True

    def reachable(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def release(self, seq: int) -> None:
        written = self._written.pop(seq, None)
        if written is not None and seq in self.kv:
            self.kv.remember(seq, written)
        super().release(seq)

    @torch.inference_mode()
    def forward(self, inputs: list[SeqInput], hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        given = inputs
        starts = [self.kv.length(inp.seq) if inp.start is None else inp.start for inp in given] \
            if self.prefix_cache else []
        fresh = self._fresh_prefills(inputs) if self.prefix_cache else {}
        if fresh and not hidden_layers:          # rows whose K/V are cached are not run again
            inputs = [self._after_cached_prefix(inp, fresh[inp.seq]) if inp.seq in fresh else inp for inp in inputs]
        try:
            layout = pack(inputs, self.kv, self.cfg.vocab_size, self.cfg.max_seq_len)
        except Exception:
            for seq in fresh:                    # refused before anything ran: the sequence is empty again
                self.kv.truncate(seq, 0)
            raise
        self.rows_processed += layout.tokens.numel()
        if self.batch_invariant:
            layout.attn_groups = plan_groups(layout, self.dtype, self.device, self.heads_per_kv)
        kernels = self.kernels_for(layout)
        self.path_counts["compiled" if kernels else "eager"] += 1
        kernels = kernels or self._eager
        try:
            logits, hidden = self.model(layout.tokens.to(self.device), layout, self.kv,
                                        layout.logit_rows.to(self.device), hidden_layers, kernels)
        except BaseException:
            for inp in given:                    # K/V half written: these sequences leave nothing behind
                self._written.pop(inp.seq, None)
            raise
        if self.prefix_cache:
            self._note_written(given, starts)
        for seq, toks in fresh.items():
            self.kv.remember(seq, toks)
        out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        return ForwardOutput(logits.to(out_dtype), layout.cu_logits, hidden, layout)

    verify_leaves = True

    def keep_leaf(self, seq: int, src: int, dst: int, token: int) -> None:
        """Position dst now holds the leaf written at position src (layout.py), token and K/V."""
        self.kv.copy(seq, src, dst)
        had = self._written.get(seq)
        if had is not None:            # the prefix cache's record of what each position holds
            if dst < len(had):
                had[dst] = token
            else:
                del self._written[seq]

    def clear_prefix_cache(self) -> None:
        self.kv.clear_cache()

    def _note_written(self, inputs: list[SeqInput], starts: list[int]) -> None:
        """Each input's tokens now hold positions start.. of its sequence (a record with a gap is dropped)."""
        for inp, start in zip(inputs, starts):
            had = self._written.setdefault(inp.seq, [])
            if len(had) < start:
                del self._written[inp.seq]
                continue
            del had[start:]                      # in place: a decode step appends one token, not the whole list
            had.extend(_ints(inp.tokens))

    def _fresh_prefills(self, inputs: list[SeqInput]) -> dict[int, list[int]]:
        """sequence -> tokens, for each input that writes an empty sequence from position 0, a full page or more."""
        return {inp.seq: _ints(inp.tokens) for inp in inputs
                if not inp.start and len(inp.tokens) > self.kv.page_size and self.kv.length(inp.seq) == 0}

    def _after_cached_prefix(self, inp: SeqInput, toks: list[int]) -> SeqInput:
        """The input without the rows whose K/V the prefix cache holds (its last row always runs: its logits, or the
        next forward's, need it; "all" logits need every row)."""
        if inp.logits == "all":
            return inp
        n = self.kv.match_prefix(inp.seq, toks[:-1])
        self.prefix_queries += len(toks)
        self.prefix_hits += n
        return SeqInput(inp.seq, toks[n:], start=n, logits=inp.logits) if n else inp

    def kernels_for(self, layout: Layout):
        """The tier gate: compiled kernels for a uniform layout whose row count is a tier, else None (eager)."""
        T = layout.tokens.numel()
        if T not in self.compile_tiers or len({s.n for s in layout.seqs}) != 1 or any(s.leaves for s in layout.seqs):
            return None
        if self._compiled is None:
            self._compiled = (torch.compile(pre_attention, dynamic=False),
                              torch.compile(post_attention, dynamic=False), F.linear)
        return self._compiled

    def score(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every position of a whole sequence, [len(tokens), V], in a temporary KV sequence."""
        seq = self.new_sequence()
        try:
            return self.forward([SeqInput(seq, tokens, logits="all")]).rows(0)
        finally:
            self.release(seq)

    def prefill(self, seqs: list[int], prompts: list[list[int]], chunk_tokens: int = 512) -> torch.Tensor:
        """Prefill many prompts, packed into forwards of at most `chunk_tokens` rows (long prompts are chunked).
        Returns the last-row logits of each prompt, [B, V]. With the prefix cache, prompts that begin like an earlier
        one of the same call run after it, taking its pages (a burst of chats with one system prompt)."""
        assert len(seqs) == len(prompts)
        later = self._followers(prompts) if self.prefix_cache else []
        if not later:
            return self._prefill(seqs, prompts, chunk_tokens)
        skip = set(later)
        first = [i for i in range(len(seqs)) if i not in skip]
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for part in (first, later):
            for i, row in zip(part, self._prefill([seqs[i] for i in part], [prompts[i] for i in part], chunk_tokens)):
                out[i] = row
        return torch.stack(out)

    def _followers(self, prompts: list[list[int]]) -> list[int]:
        """The prompts that begin with the same uncached first page as an earlier prompt of the call: run after it,
        they take its full pages and a partial one. Only when they skip SHARE_MIN_ROWS rows in all: a second forward
        streams every weight again (about a decode: SmolLM2's ~23 ms is ~37 of its prefill rows, Qwen 1.5B w4a8's
        ~55 ms ~12 rows, on a 2-core Xeon)."""
        ps, leaders, later, saved = self.kv.page_size, {}, [], 0
        for i, p in enumerate(prompts):
            p = _ints(p)
            if len(p) <= ps or self.kv.holds_first_page(p[:ps]):
                continue
            lead = leaders.setdefault(tuple(p[:ps]), p)
            if lead is not p:
                later.append(i)
                saved += min(common_prefix(lead, p), len(p) - 1, len(lead) // ps * ps)
        return later if saved >= SHARE_MIN_ROWS else []

    def _prefill(self, seqs: list[int], prompts: list[list[int]], chunk_tokens: int) -> torch.Tensor:
        done = [0] * len(seqs)          # prompts are written from position 0 (over anything cached)
        last: dict[int, torch.Tensor] = {}
        while any(d < len(p) for d, p in zip(done, prompts)):
            batch, budget, owners = [], chunk_tokens, []
            for i, (s, p) in enumerate(zip(seqs, prompts)):
                if done[i] >= len(p) or budget == 0:
                    continue
                n = min(len(p) - done[i], budget)
                finishes = done[i] + n == len(p)
                batch.append(SeqInput(s, p[done[i]:done[i] + n], start=done[i], logits="last" if finishes else "none"))
                owners.append((i, finishes))
                done[i] += n
                budget -= n
            out = self.forward(batch)
            for j, (i, finishes) in enumerate(owners):
                if finishes:
                    last[i] = out.rows(j)[-1]
        return torch.stack([last[i] for i in range(len(seqs))])
