"""Tensor parallelism: one model over N processes, Megatron-style, behind the same Backend interface as Engine.

Sharding (rank r of N; `plan_shards`):
  - attention: wqkv column-parallel by whole heads -- rank r takes its q heads and the kv heads they read (the fused
    [q | k | v] layout is sliced per part and re-fused); wo row-parallel over the same q heads, then one all-reduce.
    kv heads are split by whole GQA groups. Fewer kv heads than ranks: each kv head is replicated on N / n_kv ranks
    and each rank takes n_heads / N of its q heads (vLLM's rule; needs N % n_kv == 0 and n_heads % N == 0). More kv
    heads than ranks but not a multiple: the first n_kv % N ranks take one group more (SmolLM2-135M, 9 q / 3 kv
    heads, TP2 = 6 + 3 q heads). Exact either way -- a row-parallel sum does not care how the terms are dealt -- the
    larger shard sets the pace of attention. Anything else is refused at start, naming the valid N.
  - MLP: w_gate_up column-parallel over ffn columns, w_down row-parallel over the same columns, one all-reduce.
  - embeddings and lm_head vocab-parallel (contiguous vocab ranges): the embedding is a masked local lookup + an
    all-reduce (exact: one rank contributes, the others add zeros), the logits of the rows that need them are
    gathered to rank 0. The residual stream, norms and rotary tables are replicated.
  Each rank builds only its shard: safetensors (HF directories, and the converted cache of GGUF presets) are read by
  slice, so a rank's peak is about weights / N.

Processes: rank 0 is the caller (the server, the CLI, a test). `TPEngine.launch` starts ranks 1..N-1 as
`python -m specdec.engine.tp` processes; each loads its shard and then executes what rank 0 broadcasts: one header +
one int64 payload per forward (the packed layout: tokens, positions, KV write slots, read slots per sequence, logit
rows). KV page bookkeeping (allocate, truncate, free) lives on rank 0 only: a worker's pool is storage for its kv
heads, written and read at the slots the layout names, so a KV operation costs no message at all.

Faults: a worker reads its stdin, a pipe from rank 0, and exits when it closes -- so workers die with rank 0, also on
SIGKILL. Rank 0 polls its workers (death noticed in ~0.2 s, `on_dead` callbacks run) and every collective has a
timeout (SPECDEC_TP_TIMEOUT_S, default 30 s: a hung rank). Either way the engine turns dead and every later call
raises BackendDead; the server then answers 503 and exits for a restart.

Determinism: the all-reduce is an all-gather + a sum in rank order (float32 for bf16/fp16 partials), so every rank
holds the same bits and a given N is bitwise reproducible across runs and batch mixes (with the batch-invariant
forward). Different N sum in different orders: TP1 / TP2 / TP4 agree to rounding (1e-12 on float64 tiny models), not
bit for bit.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import BackendDead, ModelError
from .attention import plan_groups
from .engine import Engine, ForwardOutput, PagedSequences
from .kv_cache import KVPool
from .layout import Layout, SeqInput, SeqRows, pack
from .model import ModelConfig, post_attention, pre_attention

log = logging.getLogger("specdec.tp")

OP_FORWARD, OP_STOP, OP_NOOP = 1, 2, 3
HEADER = 6                                   # op, T, R, B, read slots, spare


def timeout_s() -> float:
    return float(os.environ.get("SPECDEC_TP_TIMEOUT_S", 30))


# -- the shard plan ------------------------------------------------------------------------------------------------
def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """n items in `parts` contiguous ranges, the first n % parts one longer."""
    q, r = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + q + (i < r))
    return list(zip(bounds[:-1], bounds[1:]))


def _heads(cfg: ModelConfig, n: int) -> list[tuple[tuple[int, int], tuple[int, int]]] | None:
    """(q head range, kv head range) per rank, or None when the heads cannot be dealt to n ranks."""
    H, K = cfg.n_heads, cfg.n_kv_heads
    g = H // K
    if K >= n:                                   # whole kv groups per rank (uneven when K % n)
        return [((lo * g, hi * g), (lo, hi)) for lo, hi in _split(K, n)]
    if n % K == 0 and H % n == 0:                # replicate each kv head on n / K ranks
        per, share = H // n, n // K
        return [((r * per, (r + 1) * per), (r // share, r // share + 1)) for r in range(n)]
    return None


def valid_tp(cfg: ModelConfig) -> list[int]:
    return [n for n in range(1, cfg.n_heads + 1) if _heads(cfg, n) is not None]


@dataclasses.dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    q: tuple[int, int]            # q heads
    kv: tuple[int, int]           # kv heads
    ffn: tuple[int, int]          # ffn columns
    vocab: tuple[int, int]        # vocabulary ids
    vocab_max: int                # the widest vocab range (logits are gathered at this width)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The shard as a model of its own (what `loader.build` makes)."""
        return dataclasses.replace(cfg, vocab_size=self.vocab[1] - self.vocab[0], n_heads=self.q[1] - self.q[0],
                                   n_kv_heads=self.kv[1] - self.kv[0], ffn_dim=self.ffn[1] - self.ffn[0],
                                   head_dim=cfg.hd)


def plan_shards(cfg: ModelConfig, n: int, name: str = "the model") -> list[Shard]:
    heads = _heads(cfg, n) if n >= 1 else None
    if heads is None:
        raise ModelError(f"{name} has {cfg.n_heads} query heads and {cfg.n_kv_heads} kv heads, which cannot be split "
                         f"over {n} tensor-parallel ranks", field="tp",
                         remedy=f"use --tp {' | '.join(map(str, valid_tp(cfg)))}")
    if cfg.ffn_dim < n or cfg.vocab_size < n:
        raise ModelError(f"{name} is too small for {n} tensor-parallel ranks", field="tp")
    ffn, vocab = _split(cfg.ffn_dim, n), _split(cfg.vocab_size, n)
    vmax = max(hi - lo for lo, hi in vocab)
    return [Shard(r, n, heads[r][0], heads[r][1], ffn[r], vocab[r], vmax) for r in range(n)]


# -- sharded loading -----------------------------------------------------------------------------------------------
Getter = Callable[..., torch.Tensor]     # get(hf_name, dim=None, lo=None, hi=None): the tensor or a slice of it


def shard_state_dict(cfg: ModelConfig, s: Shard, get: Getter) -> dict[str, torch.Tensor]:
    """This rank's HF-named tensors (loader.build fuses q/k/v and gate/up as for a whole model)."""
    hd = cfg.hd
    q, kv = (s.q[0] * hd, s.q[1] * hd), (s.kv[0] * hd, s.kv[1] * hd)
    sd = {"model.embed_tokens.weight": get("model.embed_tokens.weight", 0, *s.vocab),
          "model.norm.weight": get("model.norm.weight")}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = get("lm_head.weight", 0, *s.vocab)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            sd[p + n + ".weight"] = get(p + n + ".weight")
        for x, span in (("q", q), ("k", kv), ("v", kv)):
            sd[p + f"self_attn.{x}_proj.weight"] = get(p + f"self_attn.{x}_proj.weight", 0, *span)
            if cfg.qkv_bias:
                sd[p + f"self_attn.{x}_proj.bias"] = get(p + f"self_attn.{x}_proj.bias", 0, *span)
        sd[p + "self_attn.o_proj.weight"] = get(p + "self_attn.o_proj.weight", 1, *q)
        for x in ("gate", "up"):
            sd[p + f"mlp.{x}_proj.weight"] = get(p + f"mlp.{x}_proj.weight", 0, *s.ffn)
        sd[p + "mlp.down_proj.weight"] = get(p + "mlp.down_proj.weight", 1, *s.ffn)
    return sd


def _dict_getter(sd: dict[str, torch.Tensor]) -> Getter:
    def get(name, dim=None, lo=None, hi=None):
        t = sd[name]
        return (t if dim is None else t.narrow(dim, lo, hi - lo)).clone()
    return get


def _safetensors_getter(path: Path, dtype: torch.dtype) -> Getter:
    """Reads only the requested slice of each tensor (safetensors files are mmapped)."""
    from safetensors import safe_open
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors weights in {path}", field="model")
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            where.update({k: f for k in h.keys()})

    def get(name, dim=None, lo=None, hi=None):
        if name not in where:
            raise ModelError(f"tensor {name} is missing from the weights in {path}", field="model")
        with safe_open(str(where[name]), framework="pt") as h:
            sl = h.get_slice(name)
            t = sl[:] if dim is None else sl[lo:hi] if dim == 0 else sl[:, lo:hi]
        # private copies: a view of the file's mapping keeps it alive, with every page the slicing touched (a column
        # slice touches all of the tensor's pages) resident in this rank
        return t.to(dtype, copy=True)
    return get


@dataclasses.dataclass
class Source:
    """Where the weights of `name` are: its config, a slicing getter, and (rank 0) its tokenizer."""
    cfg: ModelConfig
    get: Getter
    tokenizer: Callable[[], object]


def open_source(name: str, dtype: torch.dtype) -> Source:
    from .loader import hf_dir_config, load_gguf, to_hf_state_dict
    from .registry import GGUF_PRESETS, PRESETS, TINY, converted_dir
    from .tokenizer import CharTokenizer, load_tokenizer
    if name in TINY:        # seeded in code: built whole (they are tiny), then sliced
        model = TINY[name](dtype)
        return Source(model.cfg, _dict_getter(to_hf_state_dict(model)), lambda: CharTokenizer(model.cfg.vocab_size))
    path = GGUF_PRESETS[name]() if name in GGUF_PRESETS else Path(name)
    if path.is_dir():
        return Source(hf_dir_config(path), _safetensors_getter(path, dtype), lambda: load_tokenizer(path))
    if not path.exists():
        raise ModelError(f"unknown model {name!r}: not a preset and no such file or directory", field="model",
                         remedy=f"use a preset ({', '.join(PRESETS)}), a .gguf file or an HF model directory")
    tok = lambda: load_tokenizer(path.parent, path.name)  # noqa: E731
    if os.environ.get("SPECDEC_WEIGHT_CACHE", "1") == "0":   # no converted cache: each rank dequantises it all
        model = load_gguf(path, dtype)
        return Source(model.cfg, _dict_getter(to_hf_state_dict(model)), tok)
    cached = converted_dir(path, dtype)
    if not (cached / "model.safetensors").exists():
        # Convert once in a child process, so no rank (rank 0 is the long-lived server) keeps the whole model's pages.
        dt = str(dtype).removeprefix("torch.")
        subprocess.run([sys.executable, "-c", "import sys; from specdec.engine.registry import load; "
                        "load(sys.argv[1], sys.argv[2])", name, dt], check=True)
    return Source(hf_dir_config(cached), _safetensors_getter(cached, dtype), tok)


def load_shard(src: Source, s: Shard, dtype: torch.dtype, device) -> torch.nn.Module:
    from .loader import build
    model = build(s.config(src.cfg), shard_state_dict(src.cfg, s, src.get), dtype).to(device)
    try:                # hand the slicing's freed buffers back to the OS (glibc keeps them in its heap otherwise)
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return model


# -- one rank's part of the forward ----------------------------------------------------------------------------------
class _Rank:
    """This rank's weights (an Engine over its shard: the shard model, a KV pool for its kv heads, the batch-invariant
    kernels) and the collectives that join the ranks' parts into one forward."""

    def __init__(self, engine: Engine, shard: Shard, vocab_size: int, group=None):
        self.engine, self.shard, self.vocab_size, self.group = engine, shard, vocab_size, group
        self.wire_bytes = 0       # bytes all ranks put on the wire for this rank's collectives (algorithm level)
        self.comm_s = 0.0         # seconds this rank spent in collectives (incl. waiting for the slowest rank)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's t, in rank order, identical on every rank (all-gather + local sum)."""
        N = self.shard.world
        parts = [torch.empty_like(t) for _ in range(N)]
        t0 = time.perf_counter()
        dist.all_gather(parts, t.contiguous(), group=self.group)
        self.comm_s += time.perf_counter() - t0
        self.wire_bytes += N * (N - 1) * t.numel() * t.element_size()
        acc = torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype
        out = parts[0].to(acc)
        for p in parts[1:]:
            out = out + p.to(acc)
        return out.to(t.dtype)

    def run(self, layout: Layout, hidden_layers=()) -> tuple[torch.Tensor | None, dict]:
        """The forward over this rank's shard; rank 0 gets the logits of layout.logit_rows, [R, V] (others None)."""
        eng, m, s = self.engine, self.engine.model, self.shard
        dev = eng.device
        if eng.batch_invariant:
            layout.attn_groups = plan_groups(layout, eng.dtype, dev, eng.heads_per_kv)
        pre, post, linear = eng._eager or (pre_attention, post_attention, F.linear)
        post = functools.partial(post, reduce=self.all_reduce)
        tokens = layout.tokens.to(dev)
        cos = m.rope_cos[layout.positions].to(eng.dtype).to(dev)
        sin = m.rope_sin[layout.positions].to(eng.dtype).to(dev)
        # vocab-parallel embedding: this rank's rows, zeros elsewhere, summed over ranks
        local = tokens - s.vocab[0]
        hit = (local >= 0) & (local < s.vocab[1] - s.vocab[0])
        x = self.all_reduce(m.embed(local.clamp(0, s.vocab[1] - s.vocab[0] - 1)).masked_fill(~hit[:, None], 0))
        hidden = {-1: x} if -1 in hidden_layers else {}
        for i, block in enumerate(m.layers):
            x = block(x, cos, sin, layout, eng.kv.k[i], eng.kv.v[i], (pre, post))
            if i in hidden_layers:
                hidden[i] = x
        R = layout.logit_rows.numel()
        if R == 0:
            return (x.new_zeros(0, 0) if s.rank == 0 else None), hidden
        x = m.norm(x.index_select(0, layout.logit_rows.to(dev)))
        part = linear(x, m.output_weight)
        pad = part.new_zeros(R, s.vocab_max)
        pad[:, :part.shape[1]] = part
        self.wire_bytes += (s.world - 1) * pad.numel() * pad.element_size()
        if s.rank != 0:
            dist.gather(pad, dst=0, group=self.group)
            return None, hidden
        parts = [torch.empty_like(pad) for _ in range(s.world)]
        t0 = time.perf_counter()
        dist.gather(pad, parts, dst=0, group=self.group)
        self.comm_s += time.perf_counter() - t0
        widths = [hi - lo for lo, hi in _split(self.vocab_size, s.world)]
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1), hidden


def _encode(layout: Layout) -> torch.Tensor:
    """The layout as one int64 tensor: tokens, positions, write slots, logit rows, (row0, n, reads) per sequence,
    read slots."""
    meta = torch.tensor([[s.row0, s.n, s.read_slots.numel()] for s in layout.seqs], dtype=torch.long).reshape(-1)
    return torch.cat([layout.tokens, layout.positions, layout.write_slots, layout.logit_rows, meta,
                      *[s.read_slots for s in layout.seqs]])


def _decode(h: list[int], payload: torch.Tensor) -> Layout:
    T, R, B, S = h[1:5]
    tokens, positions, writes, logit_rows, meta, reads = payload.split([T, T, T, R, 3 * B, S])
    seqs, off = [], 0
    for row0, n, k in meta.view(B, 3).tolist():
        seqs.append(SeqRows(row0, n, reads[off:off + k]))
        off += k
    lens = torch.tensor([s.n for s in seqs])
    return Layout(tokens, positions, writes, torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]), seqs,
                  logit_rows, [])


# -- rank 0 --------------------------------------------------------------------------------------------------------
class TPEngine(PagedSequences):
    """Rank 0 of an N-way tensor-parallel model: the Backend the scheduler drives (engine.backend), with the KV
    bookkeeping of all ranks. Start it with `TPEngine.launch`; `close()` stops the workers."""

    def __init__(self, cfg: ModelConfig, rank: _Rank, workers: list[subprocess.Popen], cmd_group, saved_threads):
        self.cfg, self._rank, self.workers, self._cmd = cfg, rank, workers, cmd_group
        self.local = rank.engine
        self.kv: KVPool = self.local.kv
        self.dtype, self.device, self.batch_invariant = self.local.dtype, self.local.device, self.local.batch_invariant
        self.tp = rank.shard.world
        self.dead: str | None = None
        self.on_dead: list[Callable[[str], None]] = []     # called once, from the watch thread or the caller's
        self._lock = threading.Lock()                       # one collective sequence at a time (forward, keepalive)
        self._last_op = time.monotonic()
        self._saved_threads = saved_threads
        self._closing = False
        self.forwards = 0
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    # -- start ----------------------------------------------------------------------------------------------------
    @classmethod
    def launch(cls, name: str, tp: int, *, dtype: torch.dtype, kv_tokens: int = 8192, batch_invariant: bool = True,
               device: str = "cpu", page_size: int = 16):
        """Start ranks 1..tp-1, load rank 0's shard here, join the process group. Returns (engine, tokenizer)."""
        if dist.is_initialized():     # the ranks talk over torch's default process group: one per process
            raise ModelError("this process already holds a tensor-parallel engine", field="tp",
                             remedy="close() it before launching another")
        src = open_source(name, dtype)
        shards = plan_shards(src.cfg, tp, name)        # a clear error before any process starts
        dev = torch.device(device)
        cuda = dev.type == "cuda"
        base = dev.index or 0
        backend = "nccl" if cuda else "gloo"
        saved = torch.get_num_threads()
        threads = max(1, len(os.sched_getaffinity(0)) // tp)
        store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=600))
        spec = dict(name=name, dtype=str(dtype).removeprefix("torch."), kv_tokens=kv_tokens, page_size=page_size,
                    batch_invariant=batch_invariant, port=store.port, world=tp, threads=threads,
                    device=("cuda:{}" if cuda else "cpu"), base=base, timeout_s=timeout_s())
        workers = [subprocess.Popen([sys.executable, "-m", "specdec.engine.tp", json.dumps({**spec, "rank": r})],
                                    stdin=subprocess.PIPE) for r in range(1, tp)]
        try:
            torch.set_num_threads(threads)
            rank_dev = torch.device(f"cuda:{base}") if cuda else dev
            if cuda:
                torch.cuda.set_device(rank_dev)      # nccl binds each rank's communicator to its current device
            model = load_shard(src, shards[0], dtype, rank_dev)
            local = Engine(model, kv_tokens=kv_tokens, page_size=page_size, batch_invariant=batch_invariant)
            _wait_ready(store, workers)
            dist.init_process_group(backend, store=store, rank=0, world_size=tp,
                                    timeout=datetime.timedelta(seconds=timeout_s()))
            cmd = dist.new_group(backend=backend, timeout=datetime.timedelta(hours=24))
        except BaseException:
            for w in workers:
                w.kill()
                w.wait()
            torch.set_num_threads(saved)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        engine = cls(src.cfg, _Rank(local, shards[0], src.cfg.vocab_size), workers, cmd, saved)
        return engine, src.tokenizer()

    # -- Backend (sequence bookkeeping: PagedSequences) ----------------------------------------------------------------
    @property
    def rows_processed(self) -> int:
        return self.local.rows_processed

    @property
    def wire_bytes(self) -> int:
        return self._rank.wire_bytes

    @property
    def comm_seconds(self) -> float:
        """Rank 0's time in collectives (commands, all-reduces, the logits gather), waits for other ranks included."""
        return self._rank.comm_s

    def healthy(self) -> bool:
        return self.dead is None

    def reachable(self) -> bool:
        return self.dead is None

    @torch.inference_mode()
    def forward(self, inputs: list[SeqInput], hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        with self._lock:
            if self.dead:
                raise BackendDead(f"tensor-parallel group is down: {self.dead}")
            if any(inp.leaves for inp in inputs):
                raise ValueError("tensor-parallel forwards run no verify trees (verify_leaves is False)")
            layout = pack(inputs, self.kv, self.cfg.vocab_size, self.cfg.max_seq_len)  # refusals: before any message
            self.local.rows_processed += layout.tokens.numel()
            try:
                self._send(OP_FORWARD, layout)
                logits, hidden = self._rank.run(layout, hidden_layers)
            except Exception as e:   # noqa: BLE001 - after the broadcast any failure leaves the ranks out of step
                raise BackendDead(self._die(f"forward failed on rank 0: {type(e).__name__}: {e}")) from e
            self.forwards += 1
            self._last_op = time.monotonic()
        out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        return ForwardOutput(logits.to(out_dtype), layout.cu_logits, hidden, layout)

    # chunked prefill and whole-sequence scoring, over this forward (which does not use the pool's prefix cache)
    prefill, _prefill, score = Engine.prefill, Engine._prefill, Engine.score
    prefix_cache = False

    def close(self) -> None:
        """Stop the workers (a STOP message; killed if they do not exit) and leave the process group."""
        if self._closing:
            return
        self._closing = True
        with self._lock:
            if self.dead is None:
                try:
                    self._send(OP_STOP)
                except Exception:  # noqa: BLE001 - they are killed below anyway
                    pass
            for w in self.workers:
                try:
                    w.wait(10)
                except subprocess.TimeoutExpired:
                    w.kill()
                    w.wait()
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(self._saved_threads)

    # -- internals --------------------------------------------------------------------------------------------------
    def _send(self, op: int, layout: Layout | None = None) -> None:
        payload = _encode(layout) if layout is not None else torch.zeros(0, dtype=torch.long)
        head = [op, 0, 0, 0, 0, 0]
        if layout is not None:
            head[1:5] = [layout.tokens.numel(), layout.logit_rows.numel(), len(layout.seqs),
                         sum(s.read_slots.numel() for s in layout.seqs)]
        dev = self.device if self.device.type == "cuda" else "cpu"     # nccl moves device tensors only
        t0 = time.perf_counter()
        dist.broadcast(torch.tensor(head, dtype=torch.long, device=dev), 0, group=self._cmd)
        if payload.numel():
            dist.broadcast(payload.to(dev), 0, group=self._cmd)
            self._rank.wire_bytes += (self.tp - 1) * payload.numel() * 8
        self._rank.comm_s += time.perf_counter() - t0

    def _die(self, reason: str) -> str:
        if self.dead is None:
            self.dead = reason
            log.error("tensor-parallel group down: %s", reason)
            for w in self.workers:      # the survivors cannot go on without it: stop them now
                if w.poll() is None:
                    w.kill()
            for cb in list(self.on_dead):
                try:
                    cb(reason)
                except Exception:  # noqa: BLE001
                    log.exception("on_dead callback failed")
        return reason

    def _watch(self) -> None:
        """Worker death within ~0.2 s; a keepalive on the command channel while idle (its wait has a long timeout)."""
        while not self._closing and self.dead is None:
            for r, w in enumerate(self.workers, start=1):
                if w.poll() is not None and not self._closing:
                    self._die(f"rank {r} (pid {w.pid}) exited with code {w.returncode}")
                    return
            if time.monotonic() - self._last_op > 3600 and self._lock.acquire(blocking=False):
                try:
                    self._send(OP_NOOP)
                    self._last_op = time.monotonic()
                except Exception as e:  # noqa: BLE001
                    self._die(f"keepalive failed: {e}")
                finally:
                    self._lock.release()
            time.sleep(0.2)


def _wait_ready(store, workers: list[subprocess.Popen]) -> None:
    """Each worker sets ready/<rank> ("ok" or its error) once its shard is loaded."""
    keys = [f"ready/{r}" for r in range(1, len(workers) + 1)]
    end = time.monotonic() + 1800
    while True:
        done = [k for k in keys if store.check([k])]
        for k in done:
            v = store.get(k).decode()
            if v != "ok":
                raise ModelError(f"tensor-parallel {k.replace('ready/', 'rank ')} failed to start: {v}", field="tp")
        if len(done) == len(keys):
            return
        for r, w in enumerate(workers, start=1):
            if w.poll() is not None:
                raise ModelError(f"tensor-parallel rank {r} exited with code {w.returncode} while loading",
                                 field="tp")
        if time.monotonic() > end:
            raise ModelError("tensor-parallel workers did not start within 30 minutes", field="tp")
        time.sleep(0.05)


# -- ranks 1..N-1 ----------------------------------------------------------------------------------------------------
def _exit_with_parent() -> None:
    """stdin is a pipe from rank 0: EOF means rank 0 is gone (whatever killed it), and so is this rank's purpose."""
    def watch():
        try:
            while os.read(0, 1 << 12):
                pass
        finally:
            os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(spec: dict) -> int:
    _exit_with_parent()
    rank, world = spec["rank"], spec["world"]
    torch.set_num_threads(spec["threads"])
    store = dist.TCPStore("127.0.0.1", spec["port"], world, is_master=False, timeout=datetime.timedelta(seconds=600))
    cuda = spec["device"] != "cpu"
    dev = torch.device(f"cuda:{spec['base'] + rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    try:
        dtype = getattr(torch, spec["dtype"])
        src = open_source(spec["name"], dtype)
        shard = plan_shards(src.cfg, world, spec["name"])[rank]
        model = load_shard(src, shard, dtype, dev)
        engine = Engine(model, kv_tokens=spec["kv_tokens"], page_size=spec["page_size"],
                        batch_invariant=spec["batch_invariant"])
        vocab = src.cfg.vocab_size
        del src
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        store.set(f"ready/{rank}", f"{type(e).__name__}: {e}")
        return 1
    store.set(f"ready/{rank}", "ok")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    cmd = dist.new_group(backend=backend, timeout=datetime.timedelta(hours=24))
    me = _Rank(engine, shard, vocab)
    head = torch.zeros(HEADER, dtype=torch.long, device=dev if cuda else "cpu")
    with torch.inference_mode():
        while True:
            dist.broadcast(head, 0, group=cmd)
            h = head.tolist()
            if h[0] == OP_STOP:
                break
            if h[0] == OP_NOOP:
                continue
            n = 3 * h[1] + h[2] + 3 * h[3] + h[4]
            payload = torch.empty(n, dtype=torch.long, device=head.device)
            dist.broadcast(payload, 0, group=cmd)
            me.run(_decode(h, payload.cpu()))
    # No destroy_process_group: it waits on its peers, and rank 0 is waiting for this process to exit.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(worker_main(json.loads(sys.argv[1])))
