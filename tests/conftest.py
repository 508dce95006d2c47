import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from specdec.engine.engine import Engine
from specdec.engine.registry import load


@pytest.fixture(scope="session")
def tiny_llama():
    return load("tiny-llama").model          # float64


@pytest.fixture(scope="session")
def tiny_qwen2():
    return load("tiny-qwen2").model          # float64, q/k/v bias, untied lm_head


@pytest.fixture
def tiny_engine(tiny_llama):
    return Engine(tiny_llama, kv_tokens=4096, page_size=8)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M in bf16 (the default real model), loaded once per session."""
    return load("smollm2-135m")


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
