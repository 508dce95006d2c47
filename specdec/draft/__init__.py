"""Drafters: n-gram prompt lookup, a smaller model, or a subset of the target's own layers (layer-skip).
All implement speculative.propose.Drafter; `make_drafter` builds one from a CLI/config name."""
from __future__ import annotations

import json
from pathlib import Path

from ..speculative.propose import Drafter


LOOKUPS = ("ngram", "corpus")      # drafters that copy (NAME+ngram+corpus: tried in that order before NAME's model)


def needs_target(name: str) -> bool:
    """Whether drafter `name` is built on the target model (layer-skip shares its weights, block its embedding, the
    corpus is found beside the target's shipped block drafter)."""
    return any(part in ("layer-skip", "block", "corpus") for part in name.split("+"))


def make_drafter(name: str, target_model=None, *, dtype=None, kv_tokens: int = 16384, skip: str | None = None,
                 batch_invariant: bool = True, device: str = "cpu", checkpoint: str | None = None,
                 quant: str | None = None, features: str = "local", vocab: int | None = None,
                 min_conf: float = 0.0) -> Drafter:
    """'ngram', 'corpus' (the target's own past text: draft/corpus.py), 'layer-skip' (needs the target model; `skip`
    like '0-11,18-29'), 'block', or any model name/path; NAME+ngram: prompt lookup where the context repeats, NAME's
    drafts elsewhere (e.g. 'block+ngram'); NAME+ngram+corpus: the corpus where the context has no match.
    batch_invariant: the model drafters' engine option (see Engine); device: where a model drafter runs.
    features: block only, "local" (tap the target in this process) or "wire" (the target sends them: draft server).
    vocab: model drafters (and layer-skip) draft from token ids below it only (draft.model.restrict_vocab); 0/None: all.
    min_conf: model drafters end a greedy / coupled request's block at a slot drafted with less probability."""
    base, *looks = name.split("+") if name.split("+")[-1] in LOOKUPS else (name, )
    if looks:                     # lookups where they find something, that drafter elsewhere (draft/hybrid.py)
        from .hybrid import HybridDrafter
        if any(lk not in LOOKUPS for lk in looks):
            raise ValueError(f"{name}: only {' / '.join(LOOKUPS)} may follow a drafter's name")
        lookups = [lookup_drafter(lk, target_model, checkpoint) for lk in looks]
        return HybridDrafter(make_drafter(base, target_model, dtype=dtype, kv_tokens=kv_tokens,
                                          skip=skip, batch_invariant=batch_invariant, device=device,
                                          checkpoint=checkpoint, quant=quant, features=features, vocab=vocab,
                                          min_conf=min_conf), lookups=lookups)
    if name == "ngram":
        from .ngram import NgramDrafter
        return NgramDrafter()
    if name == "corpus":
        return corpus_drafter(target_model, checkpoint)
    if name == "block":   # trained drafter on the target's hidden states (block or eagle kind, from its config)
        import torch

        from ..engine import kernels
        from .block import BlockDrafter, load_checkpoint
        if target_model is None:
            raise ValueError("block needs the target model")
        checkpoint = checkpoint or shipped_checkpoint(target_model)
        # in the target's dtype where the CPU has bf16 (an AVX-512-bf16 EPYC: 5.3 ms a 6-slot draft for SmolLM2 in bf16,
        # 13.9 in fp32) or emulates it with our bf16_linear (a Zen 2 EPYC, a 4-slot draft: 9.7 ms in fp32, 4.6 in bf16;
        # 8 requests' 26.1 -> 21.6), else in float32 (torch's emulated bf16 GEMM: a Zen 3, 6 slots 20 ms, fp32 12)
        dt = target_model.embed.weight.dtype
        if dt == torch.bfloat16 and target_model.embed.weight.device.type == "cpu" and kernels.bf16_emulated() \
                and not kernels.available():
            dt = torch.float32
        return BlockDrafter(load_checkpoint(checkpoint, target_model, dtype=dt),
                            target_model, kv_tokens=kv_tokens, features=features)
    from .model import ModelDrafter, layer_skip, restrict_vocab
    if name == "layer-skip":
        if target_model is None:
            raise ValueError("layer-skip needs the target model")
        return ModelDrafter(restrict_vocab(layer_skip(target_model, skip).to(device), vocab), kv_tokens=kv_tokens,
                            name="layer-skip", batch_invariant=batch_invariant, min_conf=min_conf)
    from ..engine.registry import load
    # quant: a draft model's own --draft-quant (layer-skip and block run on the target's weights as loaded)
    model = restrict_vocab(load(name, dtype, quant=quant).model.to(device), vocab)
    return ModelDrafter(model, kv_tokens=kv_tokens, name=name, batch_invariant=batch_invariant, min_conf=min_conf)


CHECKPOINTS = Path(__file__).parent / "checkpoints"


def shipped_checkpoint(target_model) -> str:
    """The trained block drafter shipped for this target (specdec/draft/checkpoints/<model>), matched by shape."""
    from ..errors import SpecdecError
    c = target_model.cfg
    for d in sorted(CHECKPOINTS.glob("*/config.json")):
        cfg = json.loads(d.read_text())
        if (cfg["target_dim"], cfg["target_vocab"]) == (c.dim, c.vocab_size):
            return str(d.parent)
    raise SpecdecError("no trained block drafter ships for this target", field="draft_checkpoint",
                       remedy="train one (make train-drafter) and pass its directory with --draft-checkpoint")


def lookup_drafter(name: str, target_model=None, checkpoint: str | None = None):
    """A lookup stage of NAME+ngram+corpus: prompt lookup (suffixes of 2-3 tokens) or the corpus."""
    if name == "ngram":
        from .ngram import NgramDrafter
        return NgramDrafter(max_n=3, min_n=2)
    return corpus_drafter(target_model, checkpoint)


def corpus_drafter(target_model, checkpoint: str | None = None):
    """The corpus drafter over CHECKPOINT/corpus.safetensors (default: the shipped block drafter's directory)."""
    from ..errors import SpecdecError
    from .corpus import Corpus, CorpusDrafter
    if target_model is None and checkpoint is None:
        raise ValueError("corpus needs the target model (or a checkpoint directory)")
    path = Path(checkpoint or shipped_checkpoint(target_model)) / "corpus.safetensors"
    if not path.is_file():
        raise SpecdecError(f"no corpus at {path}", field="draft_checkpoint",
                           remedy="make train-drafter writes one beside the drafter's checkpoint")
    return CorpusDrafter(Corpus.load(path))


def warm_up(drafter: Drafter, vocab_size: int | None = None) -> float | None:
    """One throwaway Propose before serving: the first real request otherwise pays the drafter's first-call costs
    (kernel set-up, a draft server's connection, the target learning which layers to send and recomputing them).
    Measured through `make run`'s stack on a Zen 3 EPYC: the first request's first Propose took 1.2 s, 7% of an
    8-request benchmark. Returns the milliseconds it took, None if it failed (a draft server not up yet: requests
    then decode plainly until it is, as after any outage)."""
    import time

    import torch

    from ..speculative.propose import DraftItem
    ctx = [1 + k % max(1, (vocab_size or 64) - 1) for k in range(16)]
    width = drafter.feature_width
    feats = torch.zeros(len(ctx) - 1, width) if width else None       # a draft server's drafter reads them
    t = time.perf_counter()
    try:
        drafter.propose([DraftItem("warm-up", ctx, len(ctx), 4, context=ctx, features=feats)])
        return (time.perf_counter() - t) * 1e3
    except Exception:  # noqa: BLE001 - warming is an optimisation; serving does not depend on it
        return None
    finally:
        try:
            drafter.release("warm-up")
        except Exception:  # noqa: BLE001
            pass
