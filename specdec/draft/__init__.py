"""Drafters: n-gram prompt lookup, a smaller model, or a subset of the target's own layers (layer-skip).
All implement spec.propose.Drafter; `make_drafter` builds one from a CLI/config name."""
from __future__ import annotations

from ..speculative.propose import Drafter


def make_drafter(name: str, target_model=None, *, dtype=None, kv_tokens: int = 16384, skip: str | None = None,
                 batch_invariant: bool = True) -> Drafter:
    """'ngram', 'layer-skip' (needs the target model; `skip` like '0-11,18-29'), or any model name/path.
    batch_invariant: the model drafters' engine option (see Engine)."""
    if name == "ngram":
        from .ngram import NgramDrafter
        return NgramDrafter()
    from .model import ModelDrafter, layer_skip
    if name == "layer-skip":
        if target_model is None:
            raise ValueError("layer-skip needs the target model")
        return ModelDrafter(layer_skip(target_model, skip), kv_tokens=kv_tokens, name="layer-skip",
                            batch_invariant=batch_invariant)
    from ..engine.registry import load
    return ModelDrafter(load(name, dtype).model, kv_tokens=kv_tokens, name=name, batch_invariant=batch_invariant)
