"""The llama.cpp peer for `specdec bench --peer-llamacpp` (opt-in: `make peers` installs llama-cpp-python, which
builds llama.cpp from its sdist). It runs the same GGUF file on the same prompt tokens and token counts as ours,
greedy, batch 1: plain decoding, and llama-cpp-python's prompt-lookup speculation (its only built-in drafter;
a draft *model* is not exposed by its Python API)."""
from __future__ import annotations

import time


def gguf_path_of(name: str):
    """The GGUF file behind a preset or a path (the peer needs the file itself)."""
    from pathlib import Path

    from ..engine.registry import GGUF_PRESETS
    from ..errors import ModelError
    path = GGUF_PRESETS[name]() if name in GGUF_PRESETS else Path(name)
    if path.suffix != ".gguf" or not path.is_file():
        raise ModelError(f"--peer-llamacpp needs a GGUF target, not {name!r}", field="target",
                         remedy="use a GGUF preset (smollm2-135m, qwen2.5-coder-*) or a .gguf path")
    return path


class LlamaCpp:
    """One llama.cpp model; `run` generates `max_tokens` greedy tokens after each prompt (EOS ignored, so both
    engines produce the same number of tokens)."""

    def __init__(self, path, threads: int, n_ctx: int = 4096, lookup: int = 0):
        try:
            from llama_cpp import Llama
        except ImportError:
            from ..errors import InvalidRequest
            raise InvalidRequest("llama-cpp-python is not installed", field="peer-llamacpp",
                                 remedy="run `make peers` (builds llama.cpp, takes a while)") from None
        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        self.llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=512, verbose=False, draft_model=draft)
        self.tokens, self.wall = 0, 0.0
        self.decode_tokens, self.decode_s = 0, 0.0     # after each prompt's first token (prefill excluded)

    def run(self, prompts: list[list[int]], max_tokens: int) -> None:
        t0 = time.perf_counter()
        for p in prompts:
            n, first = 0, None
            self.llm.reset()    # cold, as ours in the bench: llama-cpp-python reuses the previous prompt's prefix
            for _ in self.llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                n += 1
                first = first or time.perf_counter()
                if n >= max_tokens:
                    break
            self.tokens += n
            if first is not None:
                self.decode_tokens += n - 1
                self.decode_s += time.perf_counter() - first
        self.wall += time.perf_counter() - t0

    def reset_counts(self) -> None:
        self.tokens, self.wall = 0, 0.0
        self.decode_tokens, self.decode_s = 0, 0.0

    def result(self) -> dict:
        return {"tokens": self.tokens, "wall_s": self.wall, "tokens_per_s": self.tokens / max(self.wall, 1e-9),
                "decode_tokens_per_s": self.decode_tokens / max(self.decode_s, 1e-9)}
