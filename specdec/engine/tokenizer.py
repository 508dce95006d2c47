"""Tokenizers: transformers' AutoTokenizer (offline) for real models, a character tokenizer for tiny ones.

Converting a GGUF's embedded vocabulary takes seconds, so the converted tokenizer is saved once under the cache
directory and loaded from there afterwards.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..errors import ModelError
from .assets import cache_dir


class _Chat:
    """chat() and user_turn() from a tokenizer's chat_text(messages): the prompt text of a conversation."""

    def chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.chat_text(messages))

    def user_turn(self) -> tuple[list[int], list[int]]:
        """The chat template around one user message: (tokens before it, tokens after it up to the assistant's text)."""
        before, _, after = self.chat_text([{"role": "user", "content": "\x00"}]).partition("\x00")
        return self.encode(before), self.encode(after)


class Tokenizer(_Chat):
    """The few operations the system needs, over a transformers tokenizer."""

    def __init__(self, hf):
        self.hf = hf
        vocab = hf.get_vocab()
        # Chat models end a turn with <|im_end|>; base text ends with <|endoftext|>: both stop generation.
        eos = {hf.eos_token_id} | {vocab[t] for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>") if t in vocab}
        self.eos_ids = frozenset(i for i in eos if i is not None)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def chat_text(self, messages: list[dict]) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ModelError("this model's tokenizer has no chat template", field="chat", remedy="send a plain prompt")
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class CharTokenizer(_Chat):
    """For tiny models: one token per character, ids folded into the vocabulary. Decodes to printable ASCII."""

    def __init__(self, vocab_size: int, eos_id: int = 0):
        self.vocab_size, self.eos_ids = vocab_size, frozenset({eos_id})

    def encode(self, text: str) -> list[int]:
        return [1 + ord(c) % (self.vocab_size - 1) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i % 95) for i in ids if i not in self.eos_ids)

    def chat_text(self, messages: list[dict]) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def load_tokenizer(source: Path, gguf_file: str | None = None) -> Tokenizer:
    """source: an HF directory, or the directory of a GGUF file named gguf_file."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    try:
        if gguf_file is None:
            return Tokenizer(AutoTokenizer.from_pretrained(str(source)))
        st = (source / gguf_file).stat()
        key = hashlib.sha256(f"{(source / gguf_file).resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
        cached = cache_dir() / "tokenizers" / f"{Path(gguf_file).stem}-{key[:12]}"
        if (cached / "tokenizer_config.json").exists():
            return Tokenizer(AutoTokenizer.from_pretrained(str(cached)))
        hf = AutoTokenizer.from_pretrained(str(source), gguf_file=gguf_file)
        hf.save_pretrained(str(cached))
        return Tokenizer(hf)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load a tokenizer from {source / (gguf_file or '')}: {e}", field="model") from None


class StreamDecoder:
    """Incremental detokenisation: text is released once it no longer ends in a partial UTF-8 character."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.sent = tokenizer, [], 0

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.sent = text[self.sent:], len(text)
        return new
