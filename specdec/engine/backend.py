"""The verify backend: what the scheduler and the speculative step need from "the model", and nothing more.

    backend.new_sequence() -> seq          # a KV sequence (empty)
    backend.forward([SeqInput(seq, rows, start=pos, logits="all"), ...]) -> ForwardOutput
    backend.truncate(seq, n); backend.release(seq); backend.length(seq)

A step's scoring is one `forward`: every request's new rows (prefill chunk, decode anchor, or anchor + drafts)
packed together, and back come the logits of the rows asked for (`ForwardOutput.rows(i)`). Rollback of rejected
rows is `truncate` (the next forward overwrites them). Acceptance, sampling, coins and state stay above this line,
in the server process, whatever runs the model.

Implementations:
  - `engine.Engine`: the embedded engine, one process, one device.
  - `engine.tp.TPEngine`: the same forward, tensor-parallel over N processes (rank 0 is the caller's process).
  - `sglang_backend.SGLangBackend`: the model runs in an SGLang server; one batched HTTP scoring call per step
    returns top-K rows, so it is also a `TopKBackend`; its radix cache keeps prefixes, so truncate is bookkeeping.

A backend that can fail as a whole (a TP worker died) raises `BackendDead`; the server then stops taking work.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import torch

from .layout import SeqInput
from .model import ModelConfig


@runtime_checkable
class Backend(Protocol):
    cfg: ModelConfig              # the whole model's shape (vocab, context, heads), whatever the sharding
    dtype: torch.dtype
    device: torch.device
    batch_invariant: bool         # a row's logits do not depend on the rest of the forward

    @property
    def vocab_size(self) -> int: ...

    # -- KV sequences (bookkeeping; the scheduler sizes its batch by the capacity) --------------------------------
    def new_sequence(self) -> int: ...
    def release(self, seq: int) -> None: ...
    def length(self, seq: int) -> int: ...
    def truncate(self, seq: int, n: int) -> None: ...
    def has_sequence(self, seq: int) -> bool: ...

    @property
    def kv_capacity_tokens(self) -> int: ...

    @property
    def kv_free_tokens(self) -> int: ...

    @property
    def kv_page_size(self) -> int: ...     # a sequence may leave up to this many slots of its last page unused

    # -- scoring ----------------------------------------------------------------------------------------------------
    def forward(self, inputs: list[SeqInput], hidden_layers: tuple[int, ...] = ()): ...   # -> ForwardOutput
    def prefill(self, seqs: list[int], prompts: list[list[int]], chunk_tokens: int = 512) -> torch.Tensor: ...

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def healthy(self) -> bool: ...     # False once dead for good: the server stops admitting and exits for a restart
    def reachable(self) -> bool: ...   # can score right now; a remote model can be away for a while (/health 503)
    def close(self) -> None: ...


@runtime_checkable
class TopKBackend(Protocol):
    """A backend that scores rows elsewhere and returns, per row, the token plain decoding emits there instead of
    the row's logits (sglang_backend.Row in, one token list per request out, possibly stopping at the deciding row).
    Greedy and coupled acceptance need nothing more (accept.accept_targets); rejection needs all of p and is refused
    through the backend's capability table."""
    def target_tokens(self, rows: list) -> list[list[int]]: ...


@dataclasses.dataclass
class LoadedBackend:
    name: str
    backend: Backend
    tokenizer: object
    load_seconds: float
    model: object = None          # the whole model, where this process holds one (not under tensor parallelism)

    @property
    def cfg(self) -> ModelConfig:
        return self.backend.cfg


def check_device(device: str, ranks: int = 1) -> torch.device:
    """`cpu`, `cuda` or `cuda:N` (ROCm builds of torch use the same names), checked before anything loads: `ranks`
    devices from N on must exist (tensor parallelism puts rank r on cuda:N+r)."""
    from ..errors import InvalidRequest
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidRequest(f"{device!r} is not a device", field="device", remedy="use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise InvalidRequest(f"device type {dev.type!r} is not supported", field="device",
                             remedy="use cpu, cuda or cuda:N")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    first = dev.index or 0
    if first + ranks > have:
        need = f"cuda:{first}" + (f"..cuda:{first + ranks - 1}" if ranks > 1 else "")
        raise InvalidRequest(f"{need} requested but this torch sees {have} GPU(s)", field="device",
                             remedy="use --device cpu, a lower cuda:N or --tp, or a CUDA/ROCm build of torch")
    return dev


def open_backend(name: str, *, tp: int = 1, dtype=None, device: str = "cpu", kv_tokens: int = 8192,
                 batch_invariant: bool = True, quant: str | None = None) -> LoadedBackend:
    """The embedded engine for a preset / GGUF / HF directory on `device`, or with tp > 1 its tensor-parallel form
    (rank r on device index + r; engine.tp). The caller owns it: `backend.close()` when done."""
    import time

    from .engine import Engine
    from .registry import TINY, load, parse_dtype
    from .tp import TPEngine
    if tp < 1:
        from ..errors import InvalidRequest
        raise InvalidRequest(f"{tp} is not a number of ranks", field="tp", remedy="use --tp 1 or more")
    dev = check_device(device, tp)
    if tp == 1:
        lm = load(name, dtype, quant=quant)
        engine = Engine(lm.model.to(dev), kv_tokens=kv_tokens, batch_invariant=batch_invariant)
        return LoadedBackend(lm.name, engine, lm.tokenizer, lm.load_seconds, lm.model)
    if (quant or "none") != "none":   # engine/quant.py: the packed kernels are not sharded (yet)
        from ..errors import InvalidRequest
        raise InvalidRequest(f"--quant {quant} is not implemented with tensor parallelism", field="quant",
                             remedy="use --quant none with --tp > 1, or --tp 1")
    t0 = time.perf_counter()
    dt = parse_dtype(dtype, torch.float64 if name in TINY else torch.bfloat16)
    engine, tok = TPEngine.launch(name, tp, dtype=dt, kv_tokens=kv_tokens, batch_invariant=batch_invariant,
                                  device=device)
    return LoadedBackend(name, engine, tok, time.perf_counter() - t0)
