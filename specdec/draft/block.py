"""A drafter we train, conditioned on the target's own hidden states (DSpark / DFlash-like), and its EAGLE-style
autoregressive baseline, in one small module.

Inputs at a draft step (anchor = last committed token, at position a; the target has run every position < a):
  context rows  p = a-W .. a-1:  fc(norm(h_p)) + emb(tok_{p+1})      h_p = target hidden states of `layers` at p
                (EAGLE pairing: the feature that predicted tok_{p+1}, plus that token)
  kind "block": gamma mask rows  mask + slot_emb[j]   (attend to every context row and to each other)
                one forward of the trunk and one head matmul give every slot's logits; then a cheap sequential
                correction (a Markov head): logits_j += trans(corr(emb(x_{j-1}))), x_0 = anchor, rank r, so
                the slots stay coherent with the tokens actually drafted before them.
  kind "eagle": no mask rows; slot j runs the trunk over context + drafted rows (a drafted row is
                recur(own output) + emb(x_j)), the last output gives logits_j. gamma trunk forwards.

Draft vocabulary: `vocab_ids` (the most frequent target tokens in the training data). q is softmax over those ids
(through sampling.probs, so temperature/top-k/top-p apply as for the target) and exactly zero elsewhere, so greedy,
coupled and rejection acceptance stay exact: a token outside the draft vocabulary is simply never drafted.
Confidence per slot: a learned head, sigmoid(conf(norm(z_j))) ~ P(target agrees with this slot's top-1).

Features reach the drafter through `FeatureStore`: in process it taps the target Transformer's forward (prefill and
verify rows of committed tokens are recorded by KV sequence and position; nothing is recomputed); any positions it
lacks are recomputed on a private engine over the target's first max(layers)+1 layers (weights shared). Behind the
draft server (`features="wire"`) the target runs that FeatureStore and sends each session's new rows with Propose
(bfloat16, 2 * len(layers) * dim bytes a row: 3,456 for SmolLM2); the server keeps each session's window
(`WireFeatures`) and answers NEED_CONTEXT when rows are missing (restart, eviction), and the target resends its window.
"""
from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.engine import Engine
from ..engine.layout import SeqInput
from ..engine.model import Transformer, rms_norm, rope, rotary_tables
from ..engine.prepack import dense
from ..engine.quant import GGUFRows, QLinear
from ..engine.row_tiles import tile_linears
from ..speculative.accept import Mode, draft_sample
from ..speculative.propose import DraftItem, Drafter, Proposal, SessionTokens, SparseRows
from ..speculative.sampling import probs


@dataclasses.dataclass
class BlockConfig:
    target_dim: int
    target_vocab: int
    layers: tuple[int, ...]          # target layers whose outputs condition the drafter (block i's output)
    kind: str = "block"              # "block" | "eagle"
    draft_vocab: int = 8192
    n_layers: int = 1
    n_heads: int = 8
    ffn_dim: int = 1536
    gamma: int = 8                   # mask slots (block); the most slots trained
    window: int = 16                 # context rows (committed positions with features)
    corr_rank: int = 64              # Markov correction's bottleneck
    eps: float = 1e-5

    @property
    def dim(self) -> int:            # the drafter works at the target's width and shares its (frozen) embedding
        return self.target_dim

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "layers": list(self.layers)}

    @classmethod
    def from_json(cls, d: dict) -> "BlockConfig":
        return cls(**{**d, "layers": tuple(d["layers"])})


def default_layers(n_layers: int) -> tuple[int, ...]:
    """Low, middle and high target layers (EAGLE-3's choice), e.g. (1, 15, 28) of 30."""
    return tuple(sorted({1, n_layers // 2, n_layers - 2}))


# ---------------------------------------------------------------------------------------------------------- model
class Attn(nn.Module):
    def __init__(self, c: BlockConfig):
        super().__init__()
        self.nh, self.hd = c.n_heads, c.dim // c.n_heads
        self.qkv = nn.Linear(c.dim, 3 * c.dim, bias=False)
        self.o = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x, cos, sin, mask, n_out: int):
        """Every row's key and value; queries and outputs for the last n_out rows only."""
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.nh, self.hd).unbind(2)
        q, k = rope(q.reshape(B * S, self.nh, self.hd), cos, sin), rope(k.reshape(B * S, self.nh, self.hd), cos, sin)
        q, k, v = (t.reshape(B, S, self.nh, self.hd).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q[:, :, S - n_out:], k, v, attn_mask=mask[:, None, S - n_out:])
        return self.o(y.transpose(1, 2).reshape(B, n_out, D))


class Layer(nn.Module):
    def __init__(self, c: BlockConfig):
        super().__init__()
        self.eps = c.eps
        self.n1, self.n2 = nn.Parameter(torch.ones(c.dim)), nn.Parameter(torch.ones(c.dim))
        self.attn = Attn(c)
        self.up = nn.Linear(c.dim, 2 * c.ffn_dim, bias=False)
        self.down = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x, cos, sin, mask, n_out: int | None = None):
        """x [B, S, D] -> the outputs of its last n_out rows (default all): a row's output needs every row's key
        and value but only its own query, norm and MLP."""
        n_out = x.shape[1] if n_out is None else n_out
        x = x[:, x.shape[1] - n_out:] + self.attn(rms_norm(x, self.n1, self.eps), cos, sin, mask, n_out)
        g, u = self.up(rms_norm(x, self.n2, self.eps)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class BlockDraftModel(nn.Module):
    """Trainable parts + a frozen copy of the target's token embedding (`emb`, not saved in checkpoints)."""

    def __init__(self, c: BlockConfig):
        super().__init__()
        self.cfg = c
        D, K = c.dim, len(c.layers)
        self.emb = nn.Embedding(c.target_vocab, D)
        self.emb.weight.requires_grad_(False)
        self.fc = nn.Linear(K * D, D, bias=False)
        self.mask = nn.Parameter(torch.zeros(D))
        self.slot = nn.Parameter(torch.zeros(c.gamma, D))
        self.recur = nn.Linear(D, D, bias=False)                       # eagle: own output -> next row's feature
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layers))
        self.norm = nn.Parameter(torch.ones(D))
        self.head = nn.Linear(D, c.draft_vocab, bias=False)           # over vocab_ids only
        # Markov correction: a low-rank transition from the previous slot's token to logit offsets
        self.corr = nn.Sequential(nn.Linear(D, c.corr_rank, bias=False), nn.SiLU())
        self.trans = nn.Linear(c.corr_rank, c.draft_vocab, bias=False)
        self.conf = nn.Linear(D, 1)
        self.register_buffer("vocab_ids", torch.arange(c.draft_vocab))
        nn.init.zeros_(self.trans.weight)                              # corrections start as no-ops
        nn.init.zeros_(self.recur.weight)
        nn.init.normal_(self.slot, std=0.02)
        hd = D // c.n_heads
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.outer(torch.arange(c.window + c.gamma + 1, dtype=torch.float64), inv)
        cos, sin = rotary_tables(ang)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_from_target(self, target: Transformer, vocab_ids: torch.Tensor) -> "BlockDraftModel":
        """Frozen embedding = the target's; head rows start as the target's lm_head rows of the draft vocabulary
        (ascending ids: sampling over them is then the dense row's draw, ties to the lower id)."""
        if vocab_ids.numel() > 1 and not bool((vocab_ids[1:] > vocab_ids[:-1]).all()):
            raise ValueError("a drafter's vocab_ids must be distinct and ascending")
        with torch.no_grad():
            emb = target.embed.weight
            self.emb.weight.copy_(emb.dequantize() if isinstance(emb, (QLinear, GGUFRows)) else emb)   # quantized
            lm = target.output_weight
            self.vocab_ids.copy_(vocab_ids)
            self.head.weight.copy_(dense(lm)[vocab_ids])
        return self

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k != "emb.weight"}

    # -- pieces --
    def ctx_rows(self, feats, next_tok):
        """feats [B, W, K*D] (target hidden states), next_tok [B, W] -> context rows [B, W, D]."""
        K, D = len(self.cfg.layers), self.cfg.dim
        f = feats.view(*feats.shape[:2], K, D)
        f = F.rms_norm(f, (D,), eps=self.cfg.eps).reshape(*feats.shape[:2], K * D)
        return self.fc(f.to(self.fc.weight.dtype)) + self.emb(next_tok)

    def trunk(self, x, valid, n_mask: int = 0, n_out: int | None = None):
        """x [B, S, D], valid [B, S] bool (False: left padding). Context/drafted rows are causal; mask rows (block)
        see everything valid. Returns the normalised-free outputs of the last n_out rows [B, n_out, D] (default
        all): the last layer computes only those (the block kind reads its mask rows, eagle its last row; of a
        20-row SmolLM2 draft, 16 rows were context whose outputs went unread)."""
        B, S, _ = x.shape
        causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        if n_mask:
            n_ctx = S - n_mask
            causal[n_ctx:, :] = True                                   # mask rows attend to all rows
            causal[:n_ctx, n_ctx:] = False                             # context never sees mask rows
        mask = causal[None] & valid[:, None, :]
        mask = mask | torch.eye(S, dtype=torch.bool, device=x.device)[None]   # padded rows see themselves (no NaN)
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)                # positions count valid rows
        cos = self.cos[pos.reshape(-1)].to(x.dtype)
        sin = self.sin[pos.reshape(-1)].to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, n_out if i == len(self.layers) - 1 else None)
        return x

    def slot_states(self, feats, next_tok, valid, gamma: int, gammas: torch.Tensor | None = None):
        """Block kind: [B, gamma, D] slot states from one trunk forward over context + gamma mask rows. gammas [B]:
        each request's own block length (default gamma): its mask rows past it are padding that no other row sees,
        so its slots are those of a forward at its own gamma."""
        B = feats.shape[0]
        ctx = self.ctx_rows(feats, next_tok)
        m = (self.mask + self.slot[:gamma]).to(ctx.dtype)[None].expand(B, -1, -1)
        slots = valid.new_ones(B, gamma) if gammas is None else torch.arange(gamma) < gammas[:, None]
        return self.trunk(torch.cat([ctx, m], 1), torch.cat([valid, slots], 1), n_mask=gamma, n_out=gamma)

    def logits_conf(self, z):
        """Slot states -> (logits over the draft vocabulary, confidence logit): one matmul for every slot."""
        n = rms_norm(z, self.norm, self.cfg.eps)
        return self.head(n), self.conf(n).squeeze(-1)

    def correction(self, prev_tok):
        """Logit offsets from the previous slot's token (the anchor for slot 1): the sequential part, cheap (rank r)."""
        return self.trans(self.corr(self.emb(prev_tok).to(self.trans.weight.dtype)))

    # -- training: teacher forcing; prev [B, gamma] = tokens at a..a+gamma-1; returns logits [B, gamma, Vd], conf --
    def forward_train(self, feats, next_tok, valid, prev):
        gamma = prev.shape[1]
        if self.cfg.kind == "block":
            logits, conf = self.logits_conf(self.slot_states(feats, next_tok, valid, gamma))
            return logits + self.correction(prev), conf
        # eagle, with training-time test: unroll on its own outputs, tokens teacher-forced
        x, v = self.ctx_rows(feats, next_tok), valid
        outs = []
        for j in range(gamma):
            h = self.trunk(x, v, n_out=1)[:, -1]
            outs.append(h)
            if j + 1 < gamma:
                x = torch.cat([x, (self.recur(h) + self.emb(prev[:, j + 1]))[:, None]], 1)
                v = torch.cat([v, v.new_ones(v.shape[0], 1)], 1)
        return self.logits_conf(torch.stack(outs, 1))


# ------------------------------------------------------------------------------------------------ checkpoints
def save_checkpoint(model: BlockDraftModel, path: str | Path, extra: dict | None = None) -> None:
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: dense(v.detach()).contiguous().cpu() for k, v in model.trainable_state().items()},
              str(path / "drafter.safetensors"))
    (path / "config.json").write_text(json.dumps({**model.cfg.to_json(), **(extra or {})}, indent=1))


def load_checkpoint(path: str | Path, target: Transformer, dtype=torch.float32) -> BlockDraftModel:
    from safetensors.torch import load_file
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    fields = {f.name for f in dataclasses.fields(BlockConfig)}
    cfg = BlockConfig.from_json({k: v for k, v in raw.items() if k in fields})
    model = BlockDraftModel(cfg)
    state = load_file(str(path / "drafter.safetensors"))
    model.init_from_target(target, state["vocab_ids"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"emb.weight"} and not unexpected, (missing, unexpected)
    return model.to(dtype).eval()


# ------------------------------------------------------------------------------------------------ features
def _as_sent(rows: torch.Tensor) -> torch.Tensor:
    """Feature rows rounded to bfloat16 (as stored for training and sent over the wire), held as float32: the drafter
    sees the same bits in process and behind the draft server."""
    return rows.to(torch.bfloat16).float()


LEAF_ROWS = 256   # verify-tree leaf rows a feature store keeps per sequence until a kept one is asked for


class FeatureStore:
    """Target hidden states of `layers` by token prefix. `tap(target)` records every forward the target runs (per KV
    sequence, by position; a forward starting at position s drops what was recorded from s on, as the KV does), so
    in process the drafter reuses the target's prefill and verify rows. `rows(sid, toks, n)` returns the features of
    positions len(toks)-1-n .. len(toks)-2 (all committed, anchor excluded), recomputing on its own engine whatever
    no recorded sequence holds with the same prefix. A recorded row is used only if every token up to its position
    matches (but those of positions the engine's prefix cache served, which the tap never sees), so rows of rejected
    drafts are never used; and a wrong row could only cost acceptance, never exactness."""

    def __init__(self, target: Transformer, layers: tuple[int, ...], kv_tokens: int = 8192, max_sessions: int = 64):
        from .model import layer_skip
        self.layers = tuple(layers)
        upto = max(layers) + 1
        view = layer_skip(target, f"0-{upto - 1}")                   # shares weights
        view.__dict__.pop("forward", None)                             # never a tap copied from the target
        self.engine = Engine(view, kv_tokens=kv_tokens, batch_invariant=False)
        # key -> (tokens, rows, unknown): its first `unknown` positions the prefix cache served (None in both)
        self.rec: dict[object, tuple[list[int], list[torch.Tensor], int]] = {}
        self.own: dict[str, tuple[int, list[int], list[torch.Tensor]]] = {}  # sid -> (seq, tokens, rows)
        self.where: dict[str, object] = {}
        self.leaf_rows: dict[object, dict[tuple[int, int], torch.Tensor]] = {}  # key -> (position, token) -> row
        self.max_sessions, self.tapped = max_sessions, None
        self.recomputed = 0

    def tap(self, target: Transformer) -> None:
        orig = target.forward
        layers = self.layers

        def forward(tokens, layout, kv, logit_rows=None, hidden_layers=(), kernels=None):
            want = tuple(sorted(set(hidden_layers) | set(layers)))
            logits, hidden = orig(tokens, layout, kv, logit_rows, want, kernels)
            feats = _as_sent(torch.cat([hidden[i] for i in layers], -1))
            for s in layout.seqs:
                key = s.seq                                           # the KV sequence (pack names it)
                start = s.read_slots.numel() - s.n
                toks, rows, unknown = self.rec.pop(key, ([], [], 0))
                if toks and len(toks) < start:                         # a gap we never saw: cannot record
                    continue
                if not toks:
                    # a fresh sequence starting past 0: the engine took its first rows from its prefix cache and ran
                    # none of them; their tokens and rows stay unknown (None): the window a drafter reads lies
                    # later. (Such a sequence went unrecorded: every model draft then recomputed its context on the
                    # private engine, served chat at 8 requests 69 ms a draft, up to 370.)
                    toks, rows, unknown = [None] * start, [None] * start, start
                self.rec[key] = (toks[:start] + layout.tokens[s.row0:s.row0 + s.n].tolist(),
                                 rows[:start] + list(feats[s.row0:s.row0 + s.n]), min(unknown, start))
                # a verify tree's leaves: a kept one takes its chain row's place when next asked for (_recorded),
                # which may be steps later (a hybrid drafter's lookup answers without asking), so the latest
                # LEAF_ROWS are kept rather than only the last step's
                alt = self.leaf_rows.pop(key, {})
                for i in range(len(s.leaves)):
                    r = s.row0 + s.n + i
                    alt[int(layout.positions[r]), int(layout.tokens[r])] = feats[r]
                if len(alt) > LEAF_ROWS:
                    alt = dict(list(alt.items())[-LEAF_ROWS:])
                if alt:
                    self.leaf_rows[key] = alt
                while len(self.rec) > 4 * self.max_sessions:           # oldest first
                    self.leaf_rows.pop(k := next(iter(self.rec)), None)
                    self.rec.pop(k)
            return logits, {i: hidden[i] for i in hidden_layers if i in hidden}

        target.forward = forward
        self.tapped = target

    def untap(self) -> None:
        if self.tapped is not None:
            del self.tapped.forward
            self.tapped = None

    def _recorded(self, sid: str, need: list[int], lo: int):
        """Rows of a recorded sequence holding `need` whose rows lo.. are known (positions the prefix cache served
        are unknown and match any token)."""
        n = len(need)
        key = self.where.get(sid)
        cands = ([key] if key in self.rec else []) + [k for k in self.rec if k != key]
        for k in cands:
            toks, rows, u = self.rec[k]
            if len(toks) >= n and u <= lo and (toks[u:n] == need[u:] or self._adopt_leaves(k, need, u)):
                self.where[sid] = k
                return rows
        return None

    def _adopt_leaves(self, k, need: list[int], u: int) -> bool:
        """Whether the record matches `need` once the leaves committed in place of its chain rows are put there."""
        toks, rows, _ = self.rec[k]
        alt = self.leaf_rows.get(k, {})
        fix = [(p, alt.get((p, need[p]))) for p in range(u, len(need)) if toks[p] != need[p]]
        if not fix or any(r is None for _, r in fix):
            return False
        for p, r in fix:
            toks[p], rows[p] = need[p], r
        return True

    def rows(self, sid: str, toks: list[int], n: int) -> torch.Tensor:
        need = toks[:-1]                                               # positions 0 .. anchor-1
        lo = max(0, len(need) - n)
        got = self._recorded(sid, need, lo) if self.rec else None
        if got is not None:
            return torch.stack(got[lo:len(need)]) if len(need) > lo else torch.zeros(0, self._width())
        seq, have, rows = self.own.pop(sid, (None, [], []))
        self.own[sid] = (seq, have, rows)                              # LRU order
        if seq is None:
            while len(self.own) > self.max_sessions:
                self.release(next(iter(self.own)))
            seq = self.engine.new_sequence()
        keep = 0
        for a, b in zip(have, need):
            if a != b:
                break
            keep += 1
        have, rows = have[:keep], rows[:keep]
        if len(need) > keep:
            out = self.engine.forward([SeqInput(seq, need[keep:], start=keep, logits="last")], self.layers)
            rows += list(_as_sent(torch.cat([out.hidden[i] for i in self.layers], -1)))
            self.recomputed += len(need) - keep
            have = list(need)
        self.own[sid] = (seq, have, rows)
        return torch.stack(rows[lo:len(need)]) if len(need) > lo else torch.zeros(0, self._width())

    def _width(self) -> int:
        return len(self.layers) * self.engine.cfg.dim

    def release(self, sid: str) -> None:
        self.where.pop(sid, None)
        seq, _, _ = self.own.pop(sid, (None, None, None))
        if seq is not None:
            self.engine.release(seq)


class WireFeatures:
    """The draft server's copy of each session's target hidden states, as the target sends them with Propose (only
    rows it has not sent before): the last `window` committed positions per session, sessions evicted LRU. A session
    without every row its window needs is answered NEED_CONTEXT, and the target resends its whole window."""

    def __init__(self, window: int, max_sessions: int = 4096):
        self.window, self.max_sessions = window, max_sessions
        self.sessions: collections.OrderedDict[str, dict[int, torch.Tensor]] = collections.OrderedDict()

    def add(self, sid: str, start: int, rows: torch.Tensor) -> None:
        have = self.sessions.pop(sid, {})
        for i, r in enumerate(rows):
            have[start + i] = r
        top = max(have) + 1 if have else 0
        self.sessions[sid] = {p: r for p, r in have.items() if p >= top - self.window}
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)

    def rows(self, sid: str, toks: list[int], n: int) -> torch.Tensor | None:
        """Rows of positions a-n..a-1 (a = anchor position, clipped at 0), or None if any is missing."""
        have = self.sessions.get(sid)
        if have is None:
            return None
        self.sessions.move_to_end(sid)
        a = len(toks) - 1
        need = range(max(0, a - n), a)
        if any(p not in have for p in need):
            return None
        return torch.stack([have[p] for p in need]) if len(need) else torch.zeros(0, 0)

    def release(self, sid: str) -> None:
        self.sessions.pop(sid, None)


# ------------------------------------------------------------------------------------------------ the drafter
class BlockDrafter(Drafter):
    """features="local": in process, hidden states come from a FeatureStore tapped on the target's forward.
    features="wire": in the draft server, the target sends them with each Propose (WireFeatures); `target` is then
    only the source of the frozen embedding, vocabulary and context length."""

    def __init__(self, model: BlockDraftModel, target: Transformer, *, tap: bool = True, kv_tokens: int = 8192,
                 features: str = "local"):
        self.model = model.eval()
        # its linears as the engine's: prepacked once for oneDNN (not reordered every call) or, where bf16 is emulated,
        # on our bf16_linear; on row tiles, so a request's draft has the same bits whatever else is drafted with it
        tile_linears(self.model)
        self.cfg = model.cfg
        self.name = f"block-{self.cfg.kind}"
        self.V = target.cfg.vocab_size
        self.max_len = target.cfg.max_seq_len
        self.wire = features == "wire"
        if self.wire:
            self.feats = WireFeatures(self.cfg.window)
            self.feature_layers, self.feature_window = tuple(self.cfg.layers), self.cfg.window
        else:
            self.feats = FeatureStore(target, self.cfg.layers, kv_tokens=kv_tokens)
            if tap:
                self.feats.tap(target)
        self.tokens = SessionTokens()
        self.forward_ms: list[float] = []
        # items' alternatives (DraftItem.alts, verify-tree leaves) for the first slots only: deeper ones were rarely
        # kept (under 2% of the leaves past slot 2, README "Verify trees")
        self.alt_slots = 2

    @property
    def vocab_size(self) -> int:
        return self.V

    @property
    def feature_width(self) -> int:
        return len(self.cfg.layers) * self.cfg.dim if self.wire else 0

    def release(self, sid: str) -> None:
        self.tokens.drop(sid)
        self.feats.release(sid)

    def close(self) -> None:
        if not self.wire:
            self.feats.untap()

    def propose(self, items: list[DraftItem]) -> list[Proposal | None]:
        out: list[Proposal | None] = [None] * len(items)
        live = []
        for k, toks, it in self.tokens.sync_all(items):
            if self.wire and it.features is not None:
                self.feats.add(it.sid, it.features_start, it.features)
            gamma = max(0, min(it.gamma, self.cfg.gamma, self.max_len - len(toks)))
            if gamma == 0 or len(toks) < 2:
                out[k] = Proposal(anchor=toks[-1], tokens=[], confidence=[])
                continue
            rows = self.feats.rows(it.sid, toks, self.cfg.window)      # positions a-n .. a-1
            if rows is None:                                           # wire: rows missing -> NEED_CONTEXT
                continue
            live.append((k, it, toks, gamma, rows))
        # Rejection-sampled text depends on q: such a request is drafted only beside others of its gamma, so its rows
        # have one shape (window + gamma mask rows) whatever else is drafted, and its draft has the same bits. The
        # rest share one forward at their largest gamma (each one's mask rows past its own gamma unseen); their
        # outputs cannot depend on the drafts' bits, and served with adaptive gamma they ask for up to gamma lengths.
        groups: dict[int, list] = {}
        for x in live:
            groups.setdefault(x[3] if x[1].mode is Mode.REJECTION else 0, []).append(x)
        for group in groups.values():
            for k, prop in zip([x[0] for x in group], self._draft(group)):
                out[k] = prop
        return out

    @torch.inference_mode()
    def _draft(self, live) -> list[Proposal]:
        import time
        t0 = time.perf_counter()
        c, m = self.cfg, self.model
        W, B, G = c.window, len(live), max(g for _, _, _, g, _ in live)
        dt = m.fc.weight.dtype
        feats = torch.zeros(B, W, len(c.layers) * c.dim)
        nxt = torch.zeros(B, W, dtype=torch.long)
        valid = torch.zeros(B, W, dtype=torch.bool)
        for b, (_, it, toks, _, r) in enumerate(live):
            n = r.shape[0]
            if n:
                feats[b, W - n:] = r
                nxt[b, W - n:] = torch.tensor(toks[len(toks) - n:])    # tok_{p+1} for each p
                valid[b, W - n:] = True
        feats = feats.to(dt)
        anchors = torch.tensor([toks[-1] for _, _, toks, _, _ in live])
        ids = m.vocab_ids
        drafted = [[] for _ in live]
        confs = [[] for _ in live]
        qs = [[] for _ in live]
        alts = [[] for _ in live]
        A = max((it.alts for _, it, _, _, _ in live if it.mode is not Mode.REJECTION), default=0)
        prev = anchors
        if c.kind == "block":
            gammas = torch.tensor([g for _, _, _, g, _ in live])
            base, base_cf = m.logits_conf(m.slot_states(feats, nxt, valid, G, gammas))   # every slot in one forward
        else:
            x, v = m.ctx_rows(feats, nxt), valid
        for j in range(G):
            if c.kind == "block":
                lg, cf = base[:, j] + m.correction(prev), base_cf[:, j]
            else:
                z = m.trunk(x, v, n_out=1)[:, -1]
                lg, cf = m.logits_conf(z)
            lg, cf = lg.double(), torch.sigmoid(cf.double()).tolist()
            top = ids[lg.argmax(-1)].tolist()                          # greedy requests' drafts: one call for all
            alt = A > 0 and j < self.alt_slots
            if alt:                      # the slot's likeliest ids and their draft probabilities, for every request
                best, at = lg.topk(A + 1, -1)
                alt_ids, alt_p = ids[at].tolist(), (best - lg.logsumexp(-1, keepdim=True)).exp().tolist()
            for b, (_, it, toks, gamma, _) in enumerate(live):
                if j >= gamma:
                    continue
                if it.params.greedy:
                    x_j = top[b]
                else:   # q lives on the draft vocabulary (zero elsewhere): no [V] row, no hash per vocabulary id
                    q = probs(lg[b][None], it.params)[0]
                    x_j = draft_sample(q, it.mode, it.params.seed, len(toks) + j, ids=ids)   # slot j+1's position
                    qs[b].append(q)
                drafted[b].append(x_j)
                confs[b].append(cf[b])
                if alt and it.alts and it.mode is not Mode.REJECTION:
                    alts[b].append([(x, pr) for x, pr in zip(alt_ids[b], alt_p[b]) if x != x_j][:it.alts])
            prev = torch.tensor([d[-1] for d in drafted])
            if c.kind == "eagle" and j + 1 < G:
                x = torch.cat([x, (m.recur(z) + m.emb(prev).to(z.dtype))[:, None]], 1)
                v = torch.cat([v, v.new_ones(B, 1)], 1)
        props = []
        for b, (_, it, toks, gamma, _) in enumerate(live):
            q = None
            if qs[b] and it.mode is Mode.REJECTION:
                k = len(qs[b])
                q = SparseRows(ids[None].expand(k, -1).clone(), torch.stack(qs[b]))
            props.append(Proposal(anchor=toks[-1], tokens=drafted[b], confidence=confs[b], q=q, alts=alts[b] or None))
        self.forward_ms.append((time.perf_counter() - t0) * 1e3)
        return props


def random_drafter_model(target: Transformer, *, kind: str = "block", draft_vocab: int | None = None,
                         layers: tuple[int, ...] | None = None, seed: int = 0, **kw) -> BlockDraftModel:
    """An untrained drafter for `target` (tests, training's starting point): draft vocabulary = the first ids."""
    tc = target.cfg
    V = draft_vocab or min(8192, tc.vocab_size)
    heads = kw.pop("n_heads", max(1, tc.dim // 64))
    cfg = BlockConfig(target_dim=tc.dim, target_vocab=tc.vocab_size,
                      layers=layers or default_layers(tc.n_layers), kind=kind, draft_vocab=V, n_heads=heads, **kw)
    torch.manual_seed(seed)
    return BlockDraftModel(cfg).init_from_target(target, torch.arange(V))
