"""Acceptance: turn one verify step's target rows into committed tokens, for a whole ragged batch at once.

Layout (fixed: the verify layouts and the scheduler rely on it). Request i owns the target rows
cu_rows[i]:cu_rows[i+1] (verify_len_i of them, 1..gamma+1). Row j is the target distribution p for absolute position
positions[i] + j. Rows 0..verify_len_i-2 check the draft tokens draft_tokens[cu_draft[i] + j]
(cu_draft = cu_rows - arange(B+1)), whose draft distributions are the same rows of q; the last row is the bonus row.
Each request yields a_i <= verify_len_i - 1 accepted drafts followed by exactly one target token.

Modes, per request (DESIGN.md "Acceptance"):
  greedy     accept while draft == argmax p; emit argmax p of the deciding row.
  rejection  Leviathan/Chen: accept slot iff u * q(x) < p(x); after a rejection emit a sample of max(p - q, 0)
             (RESIDUAL coins); after full acceptance the bonus row is plain seeded decoding (below).
  coupled    the target's token at a row is Gumbel-max over the shared coins (= sampling.sample_seeded); accept while
             draft == that token. Output equals plain seeded decoding token for token.

One seeded sampler: a token no accepted draft decides -- the bonus row, hence every row of a request with
verify_len 1 (no drafts: speculation off, drafter down, empty proposal) -- is what plain decoding emits there:
argmax p for greedy, sampling.sample_seeded (Gumbel-max over the GUMBEL coins of its position) otherwise, in every
mode. So a step without drafts is exactly plain decoding. Only a rejected draft in rejection mode emits something
else (the residual draw), which is why rejection output depends on the step structure and coupled output does not.
The bonus row's marginal is still p: its GUMBEL coins are independent of the ACCEPT/DRAFT coins that decided the
earlier slots (other streams, other positions).

Every random number is a coin of (seed, position, stream), so the result depends on the inputs alone: not on batch
composition, row order or how this module vectorises.

Fast path: row -> (request, slot) maps come from cu_rows; every draft's verdict is computed in one flat pass and the
first failure per request is a scatter-min, greedy and rejection side by side. Coupled rows need a hash per vocabulary
id, so they are evaluated lazily, in at most gamma + 1 waves by depth, each vectorised over the batch.

accept_ref.py is the same step written as a per-slot loop; set SPECDEC_CHECK_ACCEPT=1 (or CHECK_AGAINST_REFERENCE =
True) to run both and fail loudly on any difference.

Sampling from weights w (inverse CDF, used for rejection-mode draft and residual draws): the first id whose running
sum (sequential float64 cumsum) exceeds u * sum(w). Weights stay unnormalised, so the residual needs no division and both
paths do the same arithmetic.
"""
from __future__ import annotations

import dataclasses
import enum
import os
from typing import Sequence

import torch

from . import sampling
from .coins import Stream, as_coords, coin, coins_many, gumbel_rows

__all__ = ["Mode", "AcceptOutput", "accept", "accept_targets", "plain_targets", "draft_sample", "densify",
           "residual_weights", "inverse_cdf", "sample_residual", "CHECK_AGAINST_REFERENCE"]

# Run the reference beside the fast path and assert equality (tests, debugging a deployment). Read per call too,
# so setting the environment variable later also works.
CHECK_AGAINST_REFERENCE = os.environ.get("SPECDEC_CHECK_ACCEPT", "") not in ("", "0")

_M64 = (1 << 64) - 1
# Coupled rows whose best two Gumbel scores are this close are re-decided by sampling.sample_seeded itself, so the
# argmax never hinges on last-ulp differences between batched and per-row log (other libm, other device).
_TIE_GAP = 1e-9
# Elements per chunk of Gumbel noise: keeps the hash's ~1 MB uint64 temporaries cache-sized (measured on CPU: bigger
# chunks are slower; at large vocabularies a chunk is one row and the cost per row is sample_seeded's).
_CHUNK = 1 << 17


class Mode(str, enum.Enum):
    GREEDY = "greedy"
    REJECTION = "rejection"
    COUPLED = "coupled"


_GREEDY, _REJECTION, _COUPLED = 0, 1, 2
_CODE = {Mode.GREEDY: _GREEDY, Mode.REJECTION: _REJECTION, Mode.COUPLED: _COUPLED}


@dataclasses.dataclass(eq=False)
class AcceptOutput:
    num_accepted: torch.Tensor   # LongTensor [B]; a_i <= verify_len_i - 1
    tokens: list[list[int]]      # per request: its a_i accepted drafts, then one target token (length a_i + 1)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, AcceptOutput) and self.tokens == other.tokens
                and torch.equal(self.num_accepted.cpu(), other.num_accepted.cpu()))

    __hash__ = None  # mutable, compared by value


@dataclasses.dataclass(frozen=True)
class _Batch:
    """accept()'s per-request arguments, validated once and shared by the fast path and the reference."""
    cu: list[int]                # cu_rows as Python ints
    verify_len: list[int]
    modes: list[Mode]
    seeds: list[int]             # reduced mod 2^64 (coins do the same); 0 for greedy
    positions: list[int]         # reduced mod 2^64


def _prepare(p, q, draft_tokens, cu_rows, modes, seeds, positions) -> _Batch:
    cu = [int(c) for c in torch.as_tensor(cu_rows).reshape(-1).tolist()]
    b = len(cu) - 1
    if b < 0 or cu[0] != 0 or any(hi - lo < 1 for lo, hi in zip(cu, cu[1:])):
        raise ValueError(f"cu_rows must start at 0 and grow by >= 1 row per request, got {cu}")
    if p.dim() != 2 or p.shape[0] != cu[-1]:
        raise ValueError(f"p must be [{cu[-1]}, V] (cu_rows[-1] rows), got {tuple(p.shape)}")
    n_draft, vocab = cu[-1] - b, p.shape[1]
    if tuple(draft_tokens.shape) != (n_draft,):
        raise ValueError(f"draft_tokens must be [{n_draft}] (rows - requests), got {tuple(draft_tokens.shape)}")
    if n_draft and not (0 <= int(draft_tokens.min()) and int(draft_tokens.max()) < vocab):
        raise ValueError(f"draft token ids must lie in [0, {vocab})")
    modes = [Mode(m) for m in modes]
    seeds, positions = list(seeds), [int(x) for x in positions]
    if not len(modes) == len(seeds) == len(positions) == b:
        raise ValueError(f"need one mode, seed and position per request ({b}), got "
                         f"{len(modes)}, {len(seeds)}, {len(positions)}")
    verify_len = [hi - lo for lo, hi in zip(cu, cu[1:])]
    if q is not None and tuple(q.shape) != (n_draft, vocab):
        raise ValueError(f"q must be [{n_draft}, {vocab}], got {tuple(q.shape)}")
    if q is None and any(m is Mode.REJECTION and n > 1 for m, n in zip(modes, verify_len)):
        raise ValueError("rejection mode needs the draft distributions q")
    if any(s is None for m, s in zip(modes, seeds) if m is not Mode.GREEDY):
        raise ValueError("non-greedy requests need a seed")
    seeds = [0 if m is Mode.GREEDY else int(s) & _M64 for m, s in zip(modes, seeds)]
    return _Batch(cu, verify_len, modes, seeds, [x & _M64 for x in positions])


# ---------------------------------------------------------------------------------------------------- coins, batched

def _gumbel_argmax(p: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """sampling.sample_seeded(p[rows[k]], seeds[k], positions[k]) for every k: LongTensor [len(rows)]. seeds and
    positions: int64 coordinates on p's device (coins.as_coords)."""
    n, vocab = rows.numel(), p.shape[1]
    out = torch.empty(n, dtype=torch.long, device=p.device)
    step = max(1, _CHUNK // vocab)
    for s in range(0, n, step):
        e = min(n, s + step)
        score = torch.log(p[rows[s:e]]) + gumbel_rows(seeds[s:e], positions[s:e], vocab, Stream.GUMBEL)
        top = score.topk(min(2, vocab), dim=-1)
        out[s:e] = top.indices[:, 0]
        if vocab > 1:   # near ties (and NaN) go to sample_seeded itself; topk's order among ties is unspecified
            for k in (~(top.values[:, 0] - top.values[:, 1] > _TIE_GAP)).nonzero().flatten().tolist():
                out[s + k] = sampling.sample_seeded(p[rows[s + k]], int(seeds[s + k]), int(positions[s + k]))
    return out


# ------------------------------------------------------------------------------------------------------- sampling

def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of nonnegative weights [R, V] with uniforms u [R]: the first id whose running sum exceeds
    u * total. That id always carries mass (a zero weight leaves the running sum unchanged), so zero-mass ids are
    never drawn; only u * total rounding up to the total (u can be 1.0) runs off the end: then the last id with mass."""
    cdf = weights.cumsum(-1)
    total = cdf[:, -1]
    if not bool((total > 0).all()):
        raise ValueError("cannot sample a distribution with no mass")
    ids = torch.searchsorted(cdf, (u.to(cdf) * total).unsqueeze(1), right=True).squeeze(1)
    over = ids >= weights.shape[1]
    if bool(over.any()):
        ids[over] = weights.shape[1] - 1 - (weights[over] > 0).flip(-1).int().argmax(-1)
    return ids


def residual_weights(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual max(p - q, 0) per row; p itself where that is empty (p <= q everywhere only happens
    through rounding, as both sum to 1)."""
    r = (p - q).clamp_min_(0.0)
    empty = r.amax(-1) <= 0
    if bool(empty.any()):
        r[empty] = p[empty]
    return r


def sample_residual(p: torch.Tensor, q: torch.Tensor, seeds, positions) -> torch.Tensor:
    """The correction token after a rejection, for rows p, q [R, V] at (seeds[r], positions[r])."""
    u = coins_many(as_coords(seeds, p.device), as_coords(positions, p.device), Stream.RESIDUAL)
    return inverse_cdf(residual_weights(p, q), u)


def draft_sample(q_row: torch.Tensor, mode: Mode | str, seed: int | None, position: int,
                 ids: torch.Tensor | None = None) -> int:
    """The drafter's token for one slot from its distribution q_row [V] at absolute `position`, drawn with the coins
    the verifier will use, so draft and acceptance agree by construction.

    ids: q_row is over these vocabulary ids only (ascending, zero elsewhere; a restricted draft vocabulary): the same
    token as on densify(ids, q_row) without building or hashing the whole vocabulary (tested)."""
    mode = Mode(mode)
    q_row = q_row.to(torch.float64)
    if mode is Mode.COUPLED:   # same Gumbel stream as the target: equal samples whenever q and p agree enough
        return sampling.sample_seeded(q_row, seed, position, ids)
    if mode is Mode.GREEDY:
        k = int(q_row.argmax())
    else:   # zero weights leave the running sum unchanged, so the draw over the support is the dense row's
        k = int(inverse_cdf(q_row[None], torch.tensor([coin(seed, position, Stream.DRAFT)], dtype=torch.float64))[0])
    return k if ids is None else int(ids[k])


def densify(ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Sparse draft distribution (ids [..., K], probs [..., K]) -> dense float64 [..., V]. Repeated ids add up, so
    padding with any id and probability 0 is harmless."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    probs = torch.as_tensor(probs, dtype=torch.float64, device=ids.device)
    out = torch.zeros(*ids.shape[:-1], vocab_size, dtype=torch.float64, device=ids.device)
    return out.scatter_add_(-1, ids, probs)


# ------------------------------------------------------------------------------------------------------ acceptance

def accept(p: torch.Tensor, q: torch.Tensor | None, draft_tokens: torch.Tensor, cu_rows: torch.Tensor,
           modes: Sequence[Mode | str], seeds: Sequence[int | None], positions: Sequence[int]) -> AcceptOutput:
    """Accept/reject every request's verified drafts and pick its one target token (layout: module docstring).

    p [N, V] float64 target rows; q [N-B, V] float64 draft distributions (None when no rejection request checks a
    draft); draft_tokens [N-B] long; cu_rows [B+1] long; per request a mode, a seed (ignored for greedy) and the
    absolute position decided by its first row."""
    batch = _prepare(p, q, draft_tokens, cu_rows, modes, seeds, positions)
    out = _accept_fast(p, q, draft_tokens, batch)
    if CHECK_AGAINST_REFERENCE or os.environ.get("SPECDEC_CHECK_ACCEPT", "") not in ("", "0"):
        from . import accept_ref
        ref = accept_ref.accept_reference(p, q, draft_tokens, cu_rows, modes, seeds, positions)
        if out != ref:   # not `assert`: must survive python -O
            raise AssertionError(f"accept: fast path disagrees with the reference\n fast: {out.num_accepted.tolist()}"
                                 f" {out.tokens}\n ref:  {ref.num_accepted.tolist()} {ref.tokens}")
    return out


def _accept_fast(p: torch.Tensor, q: torch.Tensor | None, draft_tokens: torch.Tensor, b: _Batch) -> AcceptOutput:
    dev, n_rows = p.device, p.shape[0]
    n_req = len(b.modes)
    if n_req == 0:
        return AcceptOutput(torch.zeros(0, dtype=torch.long), [])
    vlen = torch.tensor(b.verify_len, device=dev)
    starts = torch.tensor(b.cu[:-1], device=dev)
    req = torch.repeat_interleave(torch.arange(n_req, device=dev), vlen)      # row -> request
    slot = torch.arange(n_rows, device=dev) - starts[req]                      # row -> j within its request
    draft_rows = (slot < vlen[req] - 1).nonzero().flatten()                    # checking rows, in draft order
    req_code = torch.tensor([_CODE[m] for m in b.modes], device=dev)
    code = req_code[req]
    x = draft_tokens.to(dev)
    # Coin coordinates per row: uint64 bits in int64 tensors on the rows' device (wrap-around add, as the coins).
    seed = as_coords(b.seeds, dev)[req]
    pos = as_coords(b.positions, dev)[req] + slot

    # target[row]: the token plain decoding picks at a row (greedy: argmax, else Gumbel-max); -1 where not needed.
    # Greedy and coupled slots pass iff the draft equals it; every mode emits it at the bonus row.
    target = torch.full((n_rows,), -1, dtype=torch.long, device=dev)
    greedy = (code == _GREEDY).nonzero().flatten()
    if greedy.numel():
        target[greedy] = (p if greedy.numel() == n_rows else p[greedy]).argmax(-1)
    # Coupled rows cost a hash per vocabulary id, the one expensive thing here, so they are filled in waves by depth,
    # each wave vectorised over the batch: wave k covers slot k of every coupled request whose drafts all matched so
    # far. Work is then the rows a request reaches (like plain decoding), not verify_len, at <= gamma + 1 waves.
    active, depth = (req_code == _COUPLED).nonzero().flatten(), 0
    while active.numel():
        rows = starts[active] + depth
        target[rows] = _gumbel_argmax(p, rows, seed[rows], pos[rows])
        more = depth < vlen[active] - 1                                        # this row checks a draft
        active = active[more][x[(rows - active)[more]] == target[rows[more]]]  # draft index = row - request
        depth += 1

    # Verdict per draft slot; unreached coupled slots (target -1) fail, harmlessly: they lie past a real failure.
    ok = x == target[draft_rows]
    rej = (code[draft_rows] == _REJECTION).nonzero().flatten()                 # indices into draft_tokens / q
    if rej.numel():                                                            # Leviathan test u * q(x) < p(x)
        rows, xr = draft_rows[rej], x[rej]
        u = coins_many(seed[rows], pos[rows], Stream.ACCEPT)
        ok[rej] = u * q[rej, xr] < p[rows, xr]

    # a_i = slot of the first failed draft; verify_len_i - 1 (the bonus row decides) when none failed.
    failed = draft_rows[~ok]
    num_acc = (vlen - 1).scatter_reduce(0, req[failed], slot[failed], reduce="amin")

    # One target token per request, from its deciding row a_i. Rejection requests that reached their bonus row emit
    # plain seeded decoding's token there (Gumbel-max); those stopped by a rejection draw from the residual.
    deciding = starts + num_acc
    r = (req_code == _REJECTION).nonzero().flatten()
    if r.numel():
        stopped = num_acc[r] < vlen[r] - 1
        bonus = deciding[r[~stopped]]
        if bonus.numel():
            target[bonus] = _gumbel_argmax(p, bonus, seed[bonus], pos[bonus])
    emitted = target[deciding]
    if r.numel() and bool(stopped.any()):
        rs, ss = deciding[r[stopped]], r[stopped]
        emitted[ss] = sample_residual(p[rs], q[rs - ss], seed[rs], pos[rs])

    acc, em, xs = num_acc.tolist(), emitted.tolist(), draft_tokens.tolist()
    tokens = [xs[lo - i: lo - i + acc[i]] + [em[i]] for i, lo in enumerate(b.cu[:-1])]
    return AcceptOutput(num_acc.cpu(), tokens)


def plain_targets(logits: torch.Tensor, params: sampling.SamplingParams, position: int,
                  drafts: Sequence[int]) -> list[int]:
    """What plain decoding emits at each of a greedy or coupled request's verified rows (logits [n, V], row j at
    absolute position + j), up to and including the first row whose token differs from the draft there: all that
    accept_targets needs. A coupled row costs a softmax and a hash per vocabulary id, so rows past the first
    rejection are never computed (at T=0.7 most verified rows are); greedy rows are one argmax."""
    if params.greedy:
        return logits.argmax(-1).tolist()
    out = []
    for j in range(logits.shape[0]):
        out.append(sampling.next_token(logits[j], params, position + j))
        if j >= len(drafts) or drafts[j] != out[-1]:
            break
    return out


def accept_targets(targets: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]) -> AcceptOutput:
    """Greedy / coupled acceptance when the target gives, instead of p, the token plain decoding emits at each row
    (a top-K backend, engine/sglang_backend.py): accept drafts while they equal that token, then emit the target's
    token at the first mismatch or at the bonus row. `targets[i]` may stop at that deciding row. Same result as
    `accept` on the whole rows, since there greedy and coupled slots also pass iff draft == plain decoding's token."""
    acc, toks = [], []
    for t, d in zip(targets, drafts, strict=True):
        a = next((j for j in range(len(d)) if j >= len(t) or d[j] != t[j]), len(d))
        if a >= len(t):
            raise ValueError(f"need the target's token at row {a}, got {len(t)} rows")
        acc.append(a)
        toks.append(list(d[:a]) + [int(t[a])])
    return AcceptOutput(torch.tensor(acc, dtype=torch.long), toks)
